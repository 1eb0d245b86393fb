"""What the policy is told a step cost (engine.step_clock): the device span while the device
sets the pace, the host's busy time per cycle when the host does (a small model, batch 1)."""
from __future__ import annotations

import random

import pytest

from adaspec.config import EngineConfig
from adaspec.engine.engine import Engine
from adaspec.engine.step_clock import StepClock
from adaspec.sampling import SamplingParams

from fake_runner import FakeRunner


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_overlap_cycle_is_host_work_minus_the_wait_for_the_previous_step():
    c = FakeClock()
    clock = StepClock(c)
    c.t = 10.0
    clock.call_began()                 # call 1 launches step 1 (nothing to collect yet)
    c.t += 0.4
    clock.launched()
    c.t += 0.1
    clock.call_ended(busy=True)        # step 1's cycle: 0.5 s of host work
    c.t += 0.3                         # the caller's work between calls (sending outputs)
    clock.call_began()                 # call 2: launch step 2, then collect step 1
    c.t += 0.6
    c.t += 0.2                         # blocked on the device for step 1 ...
    assert clock.collected(waited=0.2, device=0.05) == pytest.approx(0.5)   # host-bound: host time
    clock.launched()
    clock.call_ended(busy=True)        # step 2: 0.3 before + 0.8 in the call - 0.2 waited = 0.9
    clock.call_began()
    assert clock.collected(waited=0.0, device=0.05) == pytest.approx(0.9)
    clock.launched()
    clock.call_ended(busy=False)       # the engine went idle: the wait for work is no cost
    c.t += 100.0
    clock.call_began()
    assert clock.collected(waited=0.0, device=2.0) == pytest.approx(2.0)   # device-bound: the span
    clock.call_ended(busy=True)


def test_without_overlap_the_whole_call_is_the_cost():
    c = FakeClock()
    clock = StepClock(c)
    clock.call_began()
    c.t += 0.1
    clock.launched()
    c.t += 0.5                          # the wait for the step itself: nothing overlaps it
    assert clock.collected(waited=0.5, device=0.45) == pytest.approx(0.6)
    clock.call_ended(busy=True)
    c.t += 0.2
    clock.call_began()
    clock.launched()
    c.t += 0.3
    assert clock.collected(waited=0.3, device=0.01) == pytest.approx(0.5)   # 0.2 between calls + 0.3


@pytest.mark.parametrize("overlap", [True, False])
def test_the_policy_is_fed_what_the_cadence_paid(overlap):
    """The real Engine.step with a runner whose device span is tiny and whose launches cost
    host time (1 ms off, 3 ms speculating), 0.5 ms of caller work between calls: the policy
    sees each step's 1.5 / 3.5 ms, not the span; with a slow device, the span."""
    c = FakeClock()
    launch_cost = {}

    def on_launch(plan, in_flight):
        cost = 3e-3 if plan.speculative else 1e-3
        c.t += cost
        launch_cost[id(plan)] = cost

    cfg = EngineConfig.create("fake-model", draft="x", speculation="always", num_steps=2, topk=1,
                              max_num_seqs=4, max_num_batched_tokens=64, overlap=overlap)
    runner = FakeRunner(400, random.Random(0), True, on_launch)
    runner.last_step_time = 1e-4
    engine = Engine(cfg, runner=runner)
    engine._clock = StepClock(c)
    seen = []
    observe = engine.policy.observe
    engine.policy.observe = lambda fb: (seen.append(fb), observe(fb))
    plans = []
    collect = runner.collect
    runner.collect = lambda step: (plans.append((step.plan, runner.last_step_time)), collect(step))[1]
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for i in range(40):
        if not engine.has_unfinished():
            break
        if i == 6:
            runner.last_step_time = 0.05    # now the device sets the pace
        engine.step()
        c.t += 0.5e-3
    assert len(seen) == len(plans) >= 5
    for i, (fb, (plan, span)) in enumerate(zip(seen, plans)):
        host = launch_cost[id(plan)] + (0.5e-3 if i else 0.0)   # (no caller work before the first call)
        assert fb.step_time == pytest.approx(max(host, span)), (i, plan.speculative, span)
    assert {round(fb.step_time, 6) for fb in seen} >= {3.5e-3, 0.05}
