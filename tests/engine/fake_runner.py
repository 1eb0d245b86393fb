"""A runner without a model for driving the real `Engine.step`: results are random
acceptance (`fake_execute`), step times whatever the test sets in `last_step_time`."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from adaspec.engine.step_plan import StepResult


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
    launched plan (with the plan still in flight, if any); results are `fake_execute`'s.
    Step times: what `on_launch` returns (seconds) is that step's `last_step_time` when it is
    collected, as the real runner times each step with its own events; with overlap, step N
    is collected after step N+1 was launched. None: `last_step_time` is left as it is (tests
    that set it themselves)."""

    def __init__(self, num_blocks: int, rng: random.Random, draft: bool, on_launch):
        self.num_blocks, self.rng, self.on_launch = num_blocks, rng, on_launch
        self.model_spec = SimpleNamespace(max_position=120, vocab_size=50, eos_token_ids=())
        self.draft = SimpleNamespace(num_layers=1) if draft else None
        self.device = torch.device("cpu")
        self.backend = SimpleNamespace(name="fake")
        self.graphs = None
        self.last_step_time = 1e-3
        self.last_wait = 0.0
        self.inflight = None
        self.launches = 0
        self.launch_counts = {}
        self.pdl = False

    def setup(self, max_model_len: int) -> None:
        pass

    def plans_ahead(self, plan) -> bool:
        return True

    def launch(self, plan):
        cost = self.on_launch(plan, self.inflight)
        self.inflight = plan
        self.launches += 1
        return SimpleNamespace(plan=plan, cost=cost)

    def finish(self, step) -> None:
        pass

    def collect(self, step) -> list[StepResult]:
        if self.inflight is step.plan:
            self.inflight = None
        if step.cost is not None:
            self.last_step_time = step.cost
        return fake_execute(step.plan, self.rng)
