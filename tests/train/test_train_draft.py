"""A trained EAGLE-3 head: partly right, lossless in the engine, and its attention matters.

The target is a tiny random Llama with a small init (init_std=0.05): its greedy
continuations settle into short loops and repeats, structure a one-layer head can pick up
in a few seconds of CPU training (mostly by attending to earlier pairs). The default
init_std=0.2 target is chaotic: even long training gets a head to only ~7% accuracy.
"""
from __future__ import annotations

import json

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.train import train_eagle3_head
from adaspec.train.cli import main
from adaspec.train.evaluate import replay_chain_acceptance
from adaspec.testing import make_eagle3_head

NUM_STEPS = 3
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def trained(agree_dir, trained_head_result):
    """The session's trained head (conftest): target init_std=0.05, 300 steps, seed 0."""
    head, result = trained_head_result
    return agree_dir, head, result


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1234)  # not the training prompts (seed 0, length 8)
    return [torch.randint(3, 320, (12,), generator=g).tolist() for _ in range(16)]


@pytest.fixture(scope="module")
def baseline(trained, prompts):
    target, _, _ = trained
    llm = LLM(str(target), device="cpu", dtype="float32")
    return [o.token_ids for o in llm.generate(prompts, _params())]


def _params():
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _speculate(target, head, prompts, overlap: bool = False):
    # Without overlap by default: the replay below follows the step-at-a-time schedule (with
    # overlap a step is planned before the previous one's count is known, so a request's last
    # steps may draft deeper than its remaining tokens: same output, a few more verify steps).
    llm = LLM(str(target), draft=str(head), speculation="always", num_steps=NUM_STEPS, topk=1,
              device="cpu", dtype="float32", overlap=overlap)
    outs = llm.generate(prompts, _params())
    return [o.token_ids for o in outs], llm.stats()


def test_training_result(trained):
    _, head, r = trained
    assert len(r["acc"]) == NUM_STEPS and len(r["train_acc"]) == NUM_STEPS
    # Partly right at every unrolled step (the step-k input hidden is the head's own output).
    assert all(0.3 < a < 0.95 for a in r["acc"]), r
    assert (head / "config.json").exists() and (head / "model.safetensors").exists()
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    # A 4-layer target: the upstream default (2, 2, 1) repeats a layer, so the trainer captures
    # the inputs of layers 1, 2, 3 and writes them (a default is not written: test_train_interop).
    assert r["aux_layers"] == [1, 2, 3] and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def test_speculation_is_lossless_and_partly_accepted(trained, prompts, baseline):
    target, head, _ = trained
    tokens, st = _speculate(target, head, prompts, overlap=True)
    assert tokens == baseline
    assert 1.3 < st["accept_length"] < 1 + NUM_STEPS, st
    acc, drafted = st["accepted_per_position"], st["drafted_per_position"]
    assert 0 < acc[0] < drafted[0], st  # some drafts accepted, some rejected


def test_engine_acceptance_matches_training_semantics(trained, prompts, baseline):
    """Replay the engine's chain schedule with the training-time forward: the drafter, the
    draft KV cache (pair positions, masks) and the verifier must accept exactly as much."""
    target, head, _ = trained
    _, st = _speculate(target, head, prompts)
    ref = replay_chain_acceptance(target, head, [p + o for p, o in zip(prompts, baseline)],
                                  [len(p) for p in prompts], NUM_STEPS)
    assert st["verify_steps"] == pytest.approx(ref["verify_steps"], abs=2), (st, ref)
    for a, b in zip(st["accepted_per_position"], ref["accepted_per_position"]):
        assert a == pytest.approx(b, abs=2), (st, ref)


def test_head_depends_on_its_kv(trained, prompts, baseline, tmp_path):
    """With attention switched off (o_proj = 0) the same head accepts far less."""
    from safetensors.torch import load_file

    target, head, _ = trained
    _, st = _speculate(target, head, prompts)
    sd = load_file(str(head / "model.safetensors"))
    sd["midlayer.self_attn.o_proj.weight"].zero_()
    blind = make_eagle3_head(tmp_path / "blind", target, state_dict=sd)
    tokens, st_blind = _speculate(target, blind, prompts)
    assert tokens == baseline
    assert st_blind["accept_length"] < st["accept_length"] - 0.3, (st_blind, st)


def test_main_with_custom_aux_layers(trained, prompts, baseline, tmp_path, capsys):
    """The CLI entry point; non-default capture layers are written as eagle_config ids
    (layer-output ids = input index - 1) and the engine reads them back."""
    target, _, _ = trained
    out = tmp_path / "head"
    assert main(["--target", str(target), "--out", str(out), "--steps", "3", "--seq-len", "16",
                 "--batch", "4", "--num-sequences", "16", "--ttt-steps", "2", "--seed", "3",
                 "--aux-layers", "1,2,4", "--log-every", "0", "--threads", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["steps"] == 3 and len(res["acc"]) == 2 and res["aux_layers"] == [1, 2, 4]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    tokens, _ = _speculate(target, out, prompts[:2])
    assert tokens == baseline[:2]


def test_bad_arguments(trained, tmp_path):
    target, _, _ = trained
    with pytest.raises(ValueError, match="aux_layers"):
        train_eagle3_head(target, tmp_path / "h", steps=1, aux_layers=(1, 2, 9))
    with pytest.raises(ValueError, match="seq_len"):
        train_eagle3_head(target, tmp_path / "h", steps=1, seq_len=4, prompt_len=8)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompt_formats():
    from adaspec.train.data import prompt_of_record

    assert prompt_of_record({"prompt": "def f("}) == ("def f(", False)
    assert prompt_of_record({"prompt_ids": [5, 6]}) == ([5, 6], False)
    assert prompt_of_record({"question_id": 1, "turns": ["Hi", "again"]}) == ([{"role": "user", "content": "Hi"}], True)
    conv = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                              {"from": "gpt", "value": "Hello"}]}
    assert prompt_of_record(conv) == ([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi"}], True)
    with pytest.raises(ValueError, match="no prompt"):
        prompt_of_record({"answer": "x"})


def test_train_on_files_and_prompts_then_resume(tok_model_dir, tmp_path):
    """Files, a folder and a jsonl of prompts (continued by the target with our engine); a
    frequency-chosen draft vocabulary; checkpoints; the held-out acceptance JSON; the head
    loads and is lossless; --resume continues the step counter and the loss curve."""
    from safetensors.torch import load_file

    data = tmp_path / "src"
    data.mkdir()
    (data / "a.py").write_text("def add(a, b):\n    return a + b\n\n" * 12)
    (data / "notes.txt").write_text("Speculative decoding drafts tokens and verifies them. " * 12)
    (data / "blob.bin").write_bytes(bytes(range(256)))  # not a text suffix: skipped
    prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt": "Hello world!"}, {"turns": ["Write a haiku."]},
                                            {"conversations": [{"from": "human", "value": "def add(a, b):"}]}])
    out = tmp_path / "head"
    kw = dict(data=[str(data), str(prompts)], seq_len=32, prompt_len=8, batch_size=4, num_sequences=24,
              draft_vocab_size=64, log_every=1, checkpoint_every=2, lr=3e-3, num_threads=1)
    r1 = train_eagle3_head(tok_model_dir, out, steps=4, eval_prompts=2, eval_max_tokens=8,
                           eval_specs=[(2, 1, 3), (2, 2, 4)], **kw)
    assert r1["steps"] == 4 and [s for s, _ in r1["losses"]] == [0, 1, 2, 3]
    assert r1["num_sequences"] == 24
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["torch_dtype"] == "float32"
    sd = load_file(str(out / "model.safetensors"))
    assert sd["lm_head.weight"].shape[0] == 64 and int(sd["t2d"].sum()) == 64
    t_ids = torch.arange(64) + sd["d2t"]
    assert bool(sd["t2d"][t_ids].all()) and bool((t_ids[1:] > t_ids[:-1]).all())
    ev = json.loads((out / "eval.json").read_text())
    assert [(e["kind"], e["num_draft_tokens"]) for e in ev] == [("chain", 3), ("tree", 4)]
    assert all(1.0 <= e["accept_length"] <= 3.0 for e in ev)

    prompts_ids = [[5, 6, 7, 8], [40, 41, 42]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(tok_model_dir, device="cpu").generate(prompts_ids, params)]
    spec = LLM(tok_model_dir, draft=str(out), speculation="always", num_steps=2, device="cpu")
    assert [o.token_ids for o in spec.generate(prompts_ids, params)] == ref

    r2 = train_eagle3_head(tok_model_dir, out, steps=7, resume=True, **kw)
    assert r2["steps"] == 7 and r2["losses"][:4] == r1["losses"]
    assert [s for s, _ in r2["losses"]] == list(range(7))
    with pytest.raises(ValueError, match="more --steps"):
        train_eagle3_head(tok_model_dir, out, steps=7, resume=True, **kw)


def test_cli_errors(tok_model_dir, tmp_path, capsys):
    assert main(["--target", tok_model_dir, "--out", str(tmp_path / "h"), "--data", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--target", tok_model_dir, "--out", str(tmp_path / "h2"), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
