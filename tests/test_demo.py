"""The bundled demo pair: it loads, speculation on it is lossless (chain and tree), its head
is accepted on held-out Python, and `adaspec serve` with no model arguments serves it.

tests/data/demo_heldout.jsonl holds prompts cut from Python files held out of both
trainings (scripts/demo/evaluate_demo.py --write-test-set)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from adaspec import LLM, SamplingParams
from adaspec.bench.server import ServerProcess, free_port
from adaspec.demo import DEMO_HEAD, DEMO_MODEL_NAME, DEMO_NUM_STEPS, DEMO_TARGET, demo_available

pytestmark = pytest.mark.skipif(not demo_available(), reason="the demo pair is not bundled")

PROMPTS = [json.loads(line)["prompt"] for line in
           (Path(__file__).parent / "data" / "demo_heldout.jsonl").read_text().splitlines() if line.strip()][:4]
MAX_TOKENS = 32


def _params():
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline():
    llm = LLM(str(DEMO_TARGET), device="cpu")
    return [o.token_ids for o in llm.generate(PROMPTS, _params())]


@pytest.mark.parametrize("num_steps,topk,num_draft_tokens,min_accept",
                         [(4, 1, 5, 2.0), (2, 4, 16, 2.0), (DEMO_NUM_STEPS, 1, DEMO_NUM_STEPS + 1, 2.0)],
                         ids=["chain4", "tree16", "default_depth"])
def test_demo_speculation_lossless_and_accepted(baseline, num_steps, topk, num_draft_tokens, min_accept):
    llm = LLM(str(DEMO_TARGET), draft=str(DEMO_HEAD), speculation="always", num_steps=num_steps, topk=topk,
              num_draft_tokens=num_draft_tokens, device="cpu")
    outs = llm.generate(PROMPTS, _params())
    assert [o.token_ids for o in outs] == baseline
    st = llm.stats()
    assert st["accept_length"] >= min_accept, st
    assert st["accept_length"] < num_steps + 1  # not every draft is right: the test can fail


def test_demo_files_are_small_and_in_specforge_layout():
    size = sum(f.stat().st_size for d in (DEMO_TARGET, DEMO_HEAD) for f in d.iterdir())
    assert size <= 25 * 2 ** 20
    cfg = json.loads((DEMO_HEAD / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] < cfg["vocab_size"]
    from safetensors import safe_open
    with safe_open(str(DEMO_HEAD / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "d2t", "t2d", "lm_head.weight", "midlayer.hidden_norm.weight"} <= names
    assert not any(n.startswith("embed_tokens") for n in names)


@pytest.mark.slow
def test_serve_without_model_arguments(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "adaspec.cli", "serve", "--port", str(port), "--log-level", "info"]
    trace = tmp_path / "policy"   # ADASPEC_POLICY_TRACE: what `auto` observed, written at the stop
    with ServerProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "serve.log", startup_timeout=240,
                       stop_grace=20, env={"ADASPEC_POLICY_TRACE": str(trace)}) as server:
        models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [DEMO_MODEL_NAME]
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
            "model": DEMO_MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["text"]
    log = (tmp_path / "serve.log").read_text()
    assert "speculation auto" in log and str(DEMO_HEAD) in log, log
    [written] = tmp_path.glob("policy.*.jsonl")
    head, *steps = [json.loads(line) for line in written.read_text().splitlines()]
    assert head == {"policy": "auto", "num_steps": DEMO_NUM_STEPS, "topk": 1}
    assert steps and all(len(r) == 8 and r[0] == 1 for r in steps)   # one request: batch 1 throughout
    # query rows: 1 + draft length (a chain) in a decode step; at least the prompt rows in a step with them
    assert all(r[7] == 1 + r[1] if r[3] == 0 else r[7] >= r[3] for r in steps), steps
    assert steps[0][3] > 0 and steps[0][7] == steps[0][3]   # the first step: the prompt alone


@pytest.mark.parametrize("argv,policy,num_steps,topk", [
    ([], "auto", "demo", 1),
    (["--num-steps", "3"], "auto", 3, 1),
    (["--speculation", "off"], "off", "demo", 1),        # not the "always" a draft alone implies
    (["--speculation", "always", "--num-steps", "2", "--topk", "4", "--num-draft-tokens", "8"], "always", 2, 4),
    (["--speculative-config", '{"num_speculative_tokens": 5}'], "auto", 5, 1),
    (["--model", str(DEMO_TARGET)], "off", 3, 1),        # a model given: no demo defaults
])
def test_demo_defaults_from_the_command_line(argv, policy, num_steps, topk):
    """With no --model the CLI serves the demo pair under `auto`, chains up to DEMO_NUM_STEPS
    deep; every flag given keeps its value, `--speculation off` included."""
    import argparse

    from adaspec.config import EngineConfig, add_engine_cli_args, engine_kwargs_from_cli
    from adaspec.demo import apply_demo_defaults
    p = argparse.ArgumentParser()
    add_engine_cli_args(p)
    a = p.parse_args(argv)
    apply_demo_defaults(a)
    spec = EngineConfig.create(a.model, **engine_kwargs_from_cli(a)).spec
    assert (spec.policy, spec.num_steps, spec.topk) == (policy, DEMO_NUM_STEPS if num_steps == "demo" else num_steps, topk)
    assert (spec.draft is not None) == ("--model" not in argv)


def test_text_stops_before_a_stop_token_under_speculation(baseline):
    """A step emits several tokens under speculation and its text is spelled once per step:
    a token that stops the request (here a plain word piece given as a stop id) is in the
    token ids, not in the text, with and without speculation alike."""
    from adaspec.tokenization import load_tokenizer
    tok = load_tokenizer(str(DEMO_TARGET))
    ids = baseline[0]
    k = next(i for i in range(4, len(ids)) if tok.decode([ids[i]]).strip() and ids[i] not in ids[:i])
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[ids[k]])
    texts = []
    for kw in ({}, dict(draft=str(DEMO_HEAD), speculation="always", num_steps=DEMO_NUM_STEPS)):
        out = LLM(str(DEMO_TARGET), device="cpu", **kw).generate(PROMPTS[:1], sp)[0]
        assert out.token_ids == ids[:k + 1] and out.finish_reason == "stop"
        texts.append(out.text)
    assert texts[0] == texts[1] == tok.decode(ids[:k], skip_special_tokens=True)
