"""Tensor parallelism through the engine (two gloo ranks on CPU): every step planned once on
rank 0 and executed on both. Greedy and seeded-sampled output at TP=2 equals TP=1 token for
token, with speculation off and on (chains, trees), across threshold and auto crossings, with
preemption and prefix hits (speculation off: the threshold engine's steps at 3 requests and
up); a killed worker fails the in-flight requests within seconds.
(Which architectures shard correctly: tests/parallel/test_tp_shards.py.)"""
from __future__ import annotations

import os
import signal
import time

import pytest

from adaspec import LLM, SamplingParams
from adaspec.engine.tp_driver import TPWorkerFailed
from adaspec.structured import StructuredOutput
from adaspec.testing import make_eagle3_head

BASE = list(range(5, 19))   # a shared 14-token prefix: prefix-cache hits with blocks of 4
PROMPTS = [BASE + [20], BASE + [21], [30, 31, 32], BASE + [22, 23], [40, 41, 42, 43, 44]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PARAMS = [GREEDY, SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True), GREEDY,
          SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True), GREEDY]


@pytest.fixture(scope="module")
def head(llama_dir, tmp_path_factory):
    return str(make_eagle3_head(tmp_path_factory.mktemp("tphead") / "h", llama_dir))


def both(model: str, ref: dict | None = None, **kw):
    """(TP=1 outputs, TP=2 outputs, TP=2 LLM still open) for PROMPTS / PARAMS; the TP=1
    engine is built with `ref` instead of `kw` when given."""
    one = LLM(model, device="cpu", dtype="float32", **(kw if ref is None else ref))
    assert one.engine.runner.driver is None   # the default: one process, today's path
    ref = [o.token_ids for o in one.generate(PROMPTS, PARAMS)]
    two = LLM(model, device="cpu", dtype="float32", tensor_parallel_size=2, **kw)
    return ref, [o.token_ids for o in two.generate(PROMPTS, PARAMS)], two


def test_chain_threshold_preemption_prefix_then_killed_worker(llama_dir, head):
    # A batch of 5 speculates (chains of 3) only below 3 running requests; 14 blocks of 4
    # tokens cannot hold them all: preemption, then prefix hits on the shared prefix.
    ref, got, llm = both(llama_dir, draft=head, speculation="threshold", spec_disable_batch_size=3, num_steps=3,
                         num_kv_blocks=14, block_size=4)
    try:
        assert got == ref
        st = llm.stats()
        assert st["tensor_parallel_size"] == 2
        assert st["spec_steps"] > 0 and st["nonspec_steps"] > 0, st["draft_len_histogram"]
        assert st["num_preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0
        # A worker killed mid-generation fails the requests in flight, naming it, in seconds.
        eng = llm.engine
        for _ in range(3):
            eng.add_request(None, [5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        eng.step()
        eng.step()
        assert eng.has_unfinished()
        os.kill(eng.runner.driver.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TPWorkerFailed, match=r"rank 1 died \(exit status -9\)"):
            while time.monotonic() - t0 < 30:
                eng.step()
        assert time.monotonic() - t0 < 10
        assert not eng.alive and "rank 1" in eng.death_cause
        with pytest.raises(TPWorkerFailed):   # and stays down
            llm.generate([[5, 6]], GREEDY)
    finally:
        llm.close()


def test_tree_auto(llama_dir, head):
    # auto picks per step from step times profiled at start-up (the profile runs every tree
    # depth and chain fallback through the TP engine): whatever it picks, the output is that of
    # the plain engine without speculation (lossless; the draws depend only on seed and position).
    ref, got, llm = both(llama_dir, ref={}, draft=head, speculation="auto", num_steps=2, topk=2, num_draft_tokens=4)
    try:
        assert got == ref
        # A grammar's mask is built on rank 0 during the step: refused, by name, at admission.
        with pytest.raises(ValueError, match=r"structured outputs .* tensor_parallel_size > 1"):
            llm.generate([[5, 6]], SamplingParams(structured=StructuredOutput("regex", "a+")))
        assert len(llm.generate([[5, 6]], GREEDY)[0].token_ids) == 16   # and the engine serves on
    finally:
        llm.close()


def test_expert_parallel_moe_target(tmp_path):
    """--enable-expert-parallel on a Qwen3-MoE target (8 experts, a dense MLP layer): each rank
    holds 4 whole experts; greedy and seeded-sampled output with chains of 3 equals TP=1's."""
    from moe_models import make_moe_model

    d = str(make_moe_model(tmp_path / "m", "qwen3_moe"))
    h = str(make_eagle3_head(tmp_path / "h", d))
    ref, got, llm = both(d, draft=h, speculation="always", num_steps=3, enable_expert_parallel=True)
    try:
        assert got == ref
        experts = [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "Experts"]
        assert experts and all(m.w13.shape[0] == 4 and m.first == 0 for m in experts)   # rank 0's half
        st = llm.stats()
        assert st["verify_steps"] > 0 and st["enable_expert_parallel"] is True
    finally:
        llm.close()


def test_sizes_the_model_cannot_share_fail_before_spawning(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads"):
        LLM(llama_dir, device="cpu", dtype="float32", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(--tensor-parallel-size or -tp\) must be"):
        LLM(llama_dir, device="cpu", tensor_parallel_size=0)
