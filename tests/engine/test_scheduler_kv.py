"""Scheduler and KV-cache invariants, independent of any model: the real `Engine.step` drives
a fake runner that returns random acceptance, and after every step the reservations must be
exact, rollbacks complete, and at the end every block free again."""
from __future__ import annotations

import random

import pytest

from adaspec.config import EngineConfig
from adaspec.engine.engine import Engine
from adaspec.sampling import SamplingParams

from fake_runner import FakeRunner


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy,topk,prefix", [("off", 1, True), ("always", 1, False), ("always", 4, True),
                                                ("always", 1, True)])
def test_exact_reservation_rollback_and_release(seed, policy, topk, prefix, overlap):
    """`Engine.step` with a fake runner: with overlap, step N+1 is planned and launched
    before step N's results are applied."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    num_blocks = rng.choice([64, 200, 2000]) // bs + 8
    sync = policy != "off"
    cfg = EngineConfig.create("fake-model", draft="x" if sync else None, speculation=policy, num_steps=3, topk=topk,
                              num_draft_tokens=8 if topk > 1 else None, block_size=bs,
                              enable_prefix_caching=prefix, max_num_seqs=rng.choice([2, 8]),
                              max_num_batched_tokens=rng.choice([16, 64]), overlap=overlap)
    extra = 1 if sync else 0
    need: dict = {}
    overlapped = []

    def on_launch(plan, in_flight):
        # A speculative step in flight may emit `spec_ahead` tokens more than planned for;
        # the step in flight keeps what it reserved until it is applied.
        prev = dict(need)
        need.clear()
        held = {s.req for s in in_flight.scheduled} if in_flight is not None else set()
        overlapped.append(bool(held))
        for s in plan.scheduled:
            r = s.req
            need[r] = r.num_computed + s.num_new_tokens + (s.draft.spec_slots if s.draft else 0) + extra \
                + r.spec_ahead
            if r in held:
                need[r] = max(need[r], prev[r])
            assert len(r.block_ids) == engine.kv.blocks_for(need[r]), (str(plan), r)
            assert not r.spec_ahead or overlap

    runner = FakeRunner(num_blocks, rng, sync, on_launch)
    engine = Engine(cfg, runner=runner)
    kv = engine.kv
    shared = [rng.randrange(3, 50) for _ in range(12)]   # a common prefix, for prefix hits
    for i in range(12):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 50) for _ in range(rng.randint(1, 20))]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0,
                                                          ignore_eos=True))
    reqs = list(engine.requests.values())
    for _ in range(3000):
        if not engine.has_unfinished():
            break
        engine.step()
        # Rollback: a request holds KV for its committed tokens (+ the draft's shifted slot),
        # or, while a step that includes it runs, exactly what that step reserved.
        for r in engine.scheduler.running:
            if r.in_flight:
                assert len(r.block_ids) == kv.blocks_for(need[r]), r
            else:
                assert len(r.block_ids) == kv.blocks_for(r.num_computed + extra), r
        # Conservation: every block is free or referenced exactly as often as tables hold it.
        held = [b for r in reqs for b in r.block_ids]
        assert sum(kv.ref_count) == len(held)
        assert kv.num_free + sum(1 for c in kv.ref_count if c > 0) == kv.num_blocks
    if not overlap or topk == 1:   # (tree steps wait for the previous step: host tokens)
        assert any(overlapped) == overlap
    assert runner.launches > 0
    assert not engine.scheduler.has_unfinished(), "the scheduler stopped making progress"
    assert all(r.is_finished for r in reqs)
    assert all(len(r.output_token_ids) <= r.params.max_tokens for r in reqs)
    assert kv.num_free == kv.num_blocks and all(c == 0 for c in kv.ref_count)
