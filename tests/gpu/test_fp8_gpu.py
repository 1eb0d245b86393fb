"""FP8 checkpoints and simulated acceptance under a grammar on the device (skipped without a
GPU): the weights dequantized on the GPU in bf16 are the checkpoint's dequantized model, and the
legalized drafts of simulated acceptance reach the post CUDA graphs (the benchmarks' path)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.models.loader import load_model
from adaspec.testing import make_eagle3_head, make_tiny_model
from fp8_checkpoints import write_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Written before any engine runs (tests/gpu/test_cuda.py's `models` says why)."""
    root = tmp_path_factory.mktemp("fp8_gpu")
    d = make_tiny_model(root / "llama", "llama", hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256,
                        tokenizer=True)
    return d, make_eagle3_head(root / "head", d), write_fp8(d, root / "fp8", "fp8_block")


def test_fp8_checkpoint_dequantized_on_the_gpu(models):
    _, _, q = models
    got, _, _ = load_model(q, torch.device("cuda"), "bfloat16")
    want, _, _ = load_model(Path(f"{q}_ref"), torch.device("cuda"), "bfloat16")
    for (n, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), n
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(4)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = [[o.token_ids for o in LLM(str(m), device="cuda", dtype="bfloat16").generate(prompts, sp)]
            for m in (q, f"{q}_ref")]
    assert outs[0] == outs[1]


def test_simulated_acceptance_with_a_grammar_in_the_post_graphs(models):
    pytest.importorskip("xgrammar")
    from adaspec.structured import StructuredOutput

    d, h, _ = models
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    llm = LLM(str(d), draft=str(h), speculation="always", num_steps=3, device="cuda", dtype="float32",
              spec_simulate_accept_rate=0.8, max_num_seqs=16)
    rates = []
    for structured in (None, StructuredOutput.json_schema(schema)):
        before = llm.stats()
        outs = llm.generate(["Hello"] * 16, SamplingParams(max_tokens=40, temperature=0.0,
                                                           ignore_eos=structured is None, structured=structured))
        after = llm.stats()
        rates.append((after["accepted_tokens"] - before["accepted_tokens"]) / (after["verify_steps"] - before["verify_steps"]))
    assert rates[1] > 0.8 * rates[0], rates
    for o in outs:
        if o.finish_reason == "stop":
            obj = json.loads(o.text)   # (the schema, checked without jsonschema: the device image lacks it)
            assert isinstance(obj["name"], str) and isinstance(obj["n"], int), o.text
