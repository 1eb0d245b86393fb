"""Overlap (step N+1 planned and launched before step N's results are read) must not change
any output: greedy output with and without overlap, under every policy, equals plain
decoding token for token; seeded sampling gives the same tokens either way."""
from __future__ import annotations

import pytest

from adaspec import LLM, SamplingParams
from test_engine_core import prompts_of_lengths

POLICIES = {
    "off": dict(),
    "chain3": dict(speculation="always", num_steps=3, topk=1),
    "tree": dict(speculation="always", num_steps=2, topk=4, num_draft_tokens=8),
    "threshold2": dict(speculation="threshold", spec_disable_batch_size=2, num_steps=3, topk=1),
    "auto": dict(speculation="auto", num_steps=3, topk=1),
}


def _prompts():
    shared = prompts_of_lengths([13], seed=21)[0]
    return [shared + t for t in prompts_of_lengths([3, 9, 1], seed=22)] + prompts_of_lengths([5, 21, 2], seed=23)


def _params():
    # Different lengths, so requests finish while a step that includes them is in flight.
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 7, 24, 3, 16, 11)]


@pytest.fixture(scope="module")
def reference(agree_dir):
    llm = LLM(agree_dir, device="cpu", dtype="float32", overlap=False)
    return [o.token_ids for o in llm.generate(_prompts(), _params())]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equal_with_and_without_overlap(agree_dir, trained_head, reference, policy, overlap, monkeypatch):
    from adaspec.engine import input_batch

    shifted = []   # device-side shifts of steps planned while a speculative step ran
    apply = input_batch.Shift.apply
    monkeypatch.setattr(input_batch.Shift, "apply", lambda self, *a: (shifted.append(1), apply(self, *a)))
    kw = POLICIES[policy]
    draft = dict(draft=trained_head) if kw else {}
    # A small pool and token budget: chunked prefill, prefix hits and preemption while a
    # step is in flight.
    llm = LLM(agree_dir, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=24,
              num_kv_blocks=18, overlap=overlap, **draft, **kw)
    outs = llm.generate(_prompts(), _params())
    assert [o.token_ids for o in outs] == reference
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in _params()]
    st = llm.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]
    if not overlap or policy != "tree":   # (tree steps wait for the previous step: host tokens)
        assert (st["overlapped_steps"] > 0) == overlap
    assert st["prefix_cache_hit_tokens"] > 0
    if policy == "off":
        assert st["num_preemptions"] > 0
    if policy == "chain3":
        assert st["accepted_tokens"] > 0
        assert bool(shifted) == overlap   # speculative steps overlap too


@pytest.mark.parametrize("policy", ["off", "chain3"])
def test_seeded_sampling_equal_with_and_without_overlap(agree_dir, trained_head, policy):
    prompts = _prompts()
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    kw = dict(draft=trained_head, **POLICIES[policy]) if policy != "off" else {}
    outs = {}
    for overlap in (True, False):
        llm = LLM(agree_dir, device="cpu", dtype="float32", overlap=overlap, **kw)
        outs[overlap] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]
    assert len({tuple(t) for t in outs[True]}) > 1


def test_stop_token_inside_overlap(agree_dir):
    """A request stopped by a token while its next step is in flight emits nothing more."""
    prompts = _prompts()
    plain = LLM(agree_dir, device="cpu", dtype="float32", overlap=False)
    full = plain.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    llm = LLM(agree_dir, device="cpu", dtype="float32", overlap=True)
    for o, p in zip(full, prompts):
        stop = o.token_ids[len(o.token_ids) // 2]
        sp = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop])
        a, b = plain.generate([p], sp)[0], llm.generate([p], sp)[0]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert b.finish_reason == "stop" and b.token_ids[-1] == stop
    assert llm.stats()["overlapped_steps"] > 0
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


@pytest.mark.parametrize("policy", ["off", "chain3"])
def test_incremental_outputs_add_up_under_overlap(tok_model_dir, policy):
    """Streaming sees every token once: the new_token_ids / new_text of the step outputs
    concatenate to the final output (a token still in flight is never reported early)."""
    from adaspec.engine.engine import Engine
    from adaspec.testing import make_eagle3_head

    kw = {}
    if policy != "off":
        kw = dict(draft=str(make_eagle3_head(tok_model_dir + "-head", tok_model_dir)), **POLICIES[policy])
    eng = Engine.from_kwargs(tok_model_dir, device="cpu", dtype="float32", overlap=True, **kw)
    texts = ["Hello world", "The quick brown fox jumps", "def add(a, b):"]
    for i, t in enumerate(texts):
        eng.add_request(str(i), t, SamplingParams(max_tokens=9 + 4 * i, temperature=0.0, ignore_eos=True))
    ids = {str(i): [] for i in range(len(texts))}
    text = {str(i): "" for i in range(len(texts))}
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            ids[out.request_id] += out.new_token_ids
            text[out.request_id] += out.new_text
            if out.finished:
                final[out.request_id] = out
    assert eng.stats()["overlapped_steps"] > 0
    for rid, out in final.items():
        assert ids[rid] == out.token_ids and len(out.token_ids) == 9 + 4 * int(rid)
        assert text[rid] == out.text
    assert eng.stats()["generation_tokens"] == sum(len(o.token_ids) for o in final.values())
