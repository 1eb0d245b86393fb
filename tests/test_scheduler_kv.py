"""Scheduler and KV-cache invariants, independent of any model: a fake runner returns random
acceptance, and after every step the reservations must be exact, rollbacks complete, and at
the end every block free again."""
from __future__ import annotations

import random

import pytest

from adaspec.config import SchedulerConfig, SpecConfig
from adaspec.engine.kv_cache import KVCacheManager
from adaspec.engine.request import Request
from adaspec.engine.scheduler import Scheduler, StepResult
from adaspec.sampling import SamplingParams
from adaspec.spec_decode.policy import make_policy


def fake_execute(plan, rng: random.Random, vocab: int = 50) -> list[StepResult]:
    out = []
    for s in plan.scheduled:
        if not s.samples:
            out.append(StepResult(emitted=[]))
            continue
        depth = s.draft.num_steps if s.draft is not None else 0
        acc = rng.randint(0, depth)
        out.append(StepResult(emitted=[rng.randrange(3, vocab) for _ in range(acc + 1)], num_accepted=acc,
                              tree_depth=depth, tree_nodes=s.draft.num_nodes if s.draft else 0,
                              path=list(range(1, acc + 1))))
    return out


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy,topk,prefix", [("off", 1, True), ("always", 1, False), ("always", 4, True),
                                                ("always", 1, True)])
def test_exact_reservation_rollback_and_release(seed, policy, topk, prefix, overlap):
    """The engine's step order (engine.Engine.step), with a fake runner: with overlap, step
    N+1 is planned and launched before step N's results are applied, unless N speculated."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    spec = SpecConfig(draft="x" if policy != "off" else None, policy=policy, num_steps=3, topk=topk,
                      num_draft_tokens=8 if topk > 1 else None)
    num_blocks = rng.choice([64, 200, 2000]) // bs + 8
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=prefix)
    sync = policy != "off"
    sched = Scheduler(SchedulerConfig(max_num_seqs=rng.choice([2, 8]), max_num_batched_tokens=rng.choice([16, 64])),
                      kv, make_policy(spec), max_model_len=120, draft_sync=sync)
    extra = 1 if sync else 0
    shared = [rng.randrange(3, 50) for _ in range(12)]   # a common prefix, for prefix hits
    reqs = []
    for i in range(12):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 50) for _ in range(rng.randint(1, 20))]
        r = Request(str(i), prompt, SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0,
                                                   ignore_eos=True), set())
        reqs.append(r)
        sched.add(r)
    inflight = None

    def collect():
        nonlocal inflight
        step, inflight = inflight, None
        sched.postprocess(step, fake_execute(step, rng))

    overlapped = 0
    need: dict = {}
    for _ in range(3000):
        if not sched.has_unfinished() and inflight is None:
            break
        plan = sched.schedule()
        prev, need = need, {}
        held = {s.req for s in inflight.scheduled} if inflight is not None else set()
        for s in plan.scheduled:
            r = s.req
            # A speculative step in flight may emit `spec_ahead` tokens more than planned for;
            # the step in flight keeps what it reserved until it is applied.
            need[r] = r.num_computed + s.num_new_tokens + (s.draft.spec_slots if s.draft else 0) + extra \
                + r.spec_ahead
            if r in held:
                need[r] = max(need[r], prev[r])
            assert len(r.block_ids) == kv.blocks_for(need[r]), (str(plan), r)
            assert not r.spec_ahead or overlap
        if inflight is not None and plan.empty:
            collect()
        if plan.empty:
            continue
        sched.launched(plan)
        if inflight is not None:
            overlapped += 1
            collect()
        inflight = plan
        if not overlap:
            collect()
        # Rollback: a request holds KV for its committed tokens (+ the draft's shifted slot),
        # or, while a step that includes it runs, exactly what that step reserved.
        for r in sched.running:
            if r.in_flight:
                assert len(r.block_ids) == kv.blocks_for(need[r]), r
            else:
                assert len(r.block_ids) == kv.blocks_for(r.num_computed + extra), r
        # Conservation: every block is free or referenced exactly as often as tables hold it.
        held = [b for r in reqs for b in r.block_ids]
        assert sum(kv.ref_count) == len(held)
        assert kv.num_free + sum(1 for c in kv.ref_count if c > 0) == kv.num_blocks
    if not overlap or topk == 1:   # (tree steps wait for the previous step: host tokens)
        assert (overlapped > 0) == overlap
    assert not sched.has_unfinished(), "the scheduler stopped making progress"
    assert all(r.is_finished for r in reqs)
    assert all(len(r.output_token_ids) <= r.params.max_tokens for r in reqs)
    assert kv.num_free == kv.num_blocks and all(c == 0 for c in kv.ref_count)
