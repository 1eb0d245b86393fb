"""Overlap (step N+1 planned and launched before step N's results are read) must not change
any output: greedy output with and without overlap, under every policy, equals plain
decoding token for token; seeded sampling gives the same tokens either way."""
from __future__ import annotations

import pytest

from adaspec import LLM, SamplingParams
from helpers import kernel_path, prompts_of_lengths

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
    from adaspec.device import shift as input_batch

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
    assert (st["overlapped_steps"] > 0) == overlap
    assert st["prefix_cache_hit_tokens"] > 0
    if policy == "off":
        assert st["num_preemptions"] > 0
    if policy in ("chain3", "tree"):
        assert st["accepted_tokens"] > 0
        assert bool(shifted) == overlap   # speculative steps overlap too


@pytest.mark.parametrize("policy", ["off", "chain3", "tree"])
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


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_shift_moves_slots_with_cache_index(path, monkeypatch):
    """A shifted row's slot is that of its shifted cache index, which for draft rows is not
    its position (the EAGLE-3 pair at position p lives at cache index p + 1)."""
    import torch

    kernel_path(path, monkeypatch)
    from adaspec.device.shift import Shift
    from adaspec.device.staging import Staging, stage_forward
    from adaspec.layers.attention import get_backend

    bs = 4
    table = torch.tensor([[3, 7, 5, 2, 9]], dtype=torch.int32)

    def slot(i):
        return int(table[0, i // bs]) * bs + i % bs

    stg = Staging(1 << 16, torch.device("cpu"))
    stg.begin()
    sh = Shift(stg)
    pos, ci = [5, 9, 9], [6, 12, 13]
    meta, _, _ = stage_forward(
        stg, get_backend("torch"), table, bs, 1, q_lens=[3], ctx_len=[14], kv_start=[1], req_row=[0],
        positions=pos, cache_index=ci, slots=[slot(6), slot(12), -1], max_ctx_len=20,
        shift=sh, shift_rows=([0, 1, 2], [0, 0, 0]), shift_reqs=([0], [0]))
    staged = sh.stage(stg)
    stg.commit()
    sh.apply(staged, torch.tensor([3]), table, bs)   # the step in flight emitted 3 tokens: +2
    assert meta.positions.tolist() == [7, 11, 11]
    assert meta.cache_index.tolist() == [8, 14, 15]
    assert meta.slot_mapping.tolist() == [slot(8), slot(14), -1]
    assert meta.ctx_len.tolist() == [16]
    assert meta.mask_start.tolist() == [16]   # (no tree: the mask starts at the context end, and moves with it)


def test_shift_kernels_equal_torch_ops(monkeypatch):
    """The Triton shift (one launch) does what the PyTorch ops do, on random entries of both
    views, repeated elements, slots that must stay -1, and rows that moved by 0..3."""
    import numpy as np
    import torch

    from adaspec.device.shift import Shift
    from adaspec.device.staging import Staging

    kernel_path("triton", monkeypatch)
    rng = np.random.default_rng(3)
    bs, rows = 4, 6
    table = torch.as_tensor(rng.permutation(64)[: rows * 10].reshape(rows, 10), dtype=torch.int32)
    last_count = torch.as_tensor(rng.integers(1, 5, rows))
    pos0, ci0 = rng.integers(0, 20, 40), rng.integers(0, 20, 30)
    slots0 = np.where(rng.random(25) < 0.3, -1, 7)
    idx64 = np.concatenate([np.arange(40), [3, 3, 17]])        # element 3 moves three times
    r64 = rng.integers(0, rows, 43)
    r32 = rng.integers(0, rows, 30)
    base, rs = rng.integers(0, 30, 25), rng.integers(0, rows, 25)
    from adaspec.device import shift_kernels

    ran = []
    kernels = shift_kernels.shift_apply
    monkeypatch.setattr(shift_kernels, "shift_apply", lambda *a: ran.append(kernels(*a)) or ran[-1])
    out = {}
    for path in ("torch", "triton"):
        kernel_path(path, monkeypatch)
        stg = Staging(1 << 14, torch.device("cpu"))
        stg.begin()
        sh = Shift(stg)
        pos, ci, slots = stg.add(pos0, torch.int64), stg.add(ci0, torch.int32), stg.add(slots0, torch.int64)
        sh.add(pos, idx64, r64)
        sh.add(ci, np.arange(30), r32)
        sh.add_slots(slots, np.arange(25), base, rs)
        staged = sh.stage(stg)
        stg.commit()
        sh.apply(staged, last_count, table, bs)
        out[path] = (pos.t.clone(), ci.t.clone(), slots.t.clone())
    assert ran == [False, True]   # the ops, then the kernels
    for a, b in zip(out["torch"], out["triton"]):
        assert torch.equal(a, b), (a, b)
    assert not torch.equal(out["torch"][0], torch.as_tensor(pos0))   # the shift did something
    assert (out["torch"][2] == -1).tolist() == (slots0 == -1).tolist()
    # A slot is that of its staged cache index moved by its row's delta.
    want = [-1 if s0 < 0 else int(table[r, (b + int(last_count[r]) - 1) // bs]) * bs + (b + int(last_count[r]) - 1) % bs
            for s0, b, r in zip(slots0, base, rs)]
    assert out["triton"][2].tolist() == want
    # The start-up warm-up launches the kernel and changes no engine state.
    kernel_path("triton", monkeypatch)
    lc = last_count.clone()
    assert kernels.__module__ == shift_kernels.__name__ and shift_kernels.warm_up(last_count, table, bs)
    assert torch.equal(last_count, lc)


@pytest.mark.parametrize("policy", ["chain3", "tree"])
def test_draft_cache_equal_with_and_without_overlap(agree_dir, trained_head, policy):
    """The draft KV a request leaves behind is the same with and without overlap: draft steps
    of a request whose previous step was in flight write where they would have written."""
    import torch

    from adaspec.engine.engine import Engine

    prompt = _prompts()[1]
    caches = {}
    for overlap in (False, True):
        eng = Engine.from_kwargs(agree_dir, device="cpu", dtype="float32", block_size=4, overlap=overlap,
                                 draft=trained_head, **POLICIES[policy])
        eng.add_request("r", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        req = eng.requests["r"]
        blocks = []
        while eng.has_unfinished():
            eng.step()
            if len(req.block_ids) > len(blocks):   # a running request's blocks only grow at the tail
                blocks = list(req.block_ids)
        n = len(req.all_token_ids)
        bs = eng.config.cache.block_size
        # Committed pairs (hidden_p, token_{p+1}) live at draft slot p + 1; the last ones,
        # of steps with one token left to emit (no speculation, so no refresh), are not written.
        assert n - 3 <= req.draft_valid_len, (req.draft_valid_len, n)
        slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(1, n)])
        caches[overlap] = (eng.runner.draft_kv[:, :, slots].clone(), req.draft_valid_len)
        assert eng.stats()["accepted_tokens"] > 0
    v = min(caches[True][1], caches[False][1], len(slots))
    torch.testing.assert_close(caches[True][0][:, :, :v], caches[False][0][:, :, :v], rtol=1e-4, atol=1e-5)
