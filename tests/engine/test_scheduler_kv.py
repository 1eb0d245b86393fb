"""Scheduler and KV-cache invariants, independent of any model: the real `Engine.step` drives
a fake runner that returns random acceptance, and after every step the reservations must be
exact, rollbacks complete, and at the end every block free again."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from adaspec.config import EngineConfig
from adaspec.engine.engine import Engine
from adaspec.engine.scheduler import StepResult
from adaspec.sampling import SamplingParams


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


class FakeRunner:
    """ModelRunner's surface without a model: `on_launch(plan, in_flight_plan)` sees every
    launched plan (with the plan still in flight, if any); results are `fake_execute`'s."""

    def __init__(self, num_blocks: int, rng: random.Random, draft: bool, on_launch):
        self.num_blocks, self.rng, self.on_launch = num_blocks, rng, on_launch
        self.model_spec = SimpleNamespace(max_position=120, vocab_size=50, eos_token_ids=())
        self.draft = SimpleNamespace(num_layers=1) if draft else None
        self.device = torch.device("cpu")
        self.backend = SimpleNamespace(name="fake")
        self.graphs = None
        self.last_step_time = 1e-3
        self.inflight = None
        self.launches = 0

    def setup(self, max_model_len: int) -> None:
        pass

    def plans_ahead(self, plan) -> bool:
        return True

    def launch(self, plan):
        self.on_launch(plan, self.inflight)
        self.inflight = plan
        self.launches += 1
        return SimpleNamespace(plan=plan)

    def collect(self, step) -> list[StepResult]:
        if self.inflight is step.plan:
            self.inflight = None
        return fake_execute(step.plan, self.rng)


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
