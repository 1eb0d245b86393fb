"""benchmarks/auto_sim.py: the real `auto` policy against fixed draft lengths in simulation,
with measured noise, per-request acceptance and paired seeds (session 14)."""
from __future__ import annotations

import json

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def sim():
    return load_benchmark("auto_sim")


def _trace(path, costs: dict[int, list[float]]):
    recs = [{"depth": d, "decided": d, "pos": 4, "prev": d, "cost_ms": c, "prefill": 0, "batch": 1}
            for d, cs in costs.items() for c in cs]
    recs.append({"depth": 0, "decided": 0, "pos": 1, "prev": 0, "cost_ms": 99.0, "prefill": 0, "batch": 1})
    path.write_text(json.dumps({"records": recs}))
    return path


def test_noise_draws_are_each_steps_cost_over_its_lengths_median(sim, tmp_path):
    draws = sim.noise_draws(str(_trace(tmp_path / "t.json", {0: [1.0, 2.0, 3.0], 2: [4.0, 4.0, 8.0]})))
    # the first step of a run (99 ms, pos 1) is left out: a switch, not the host's noise
    assert sorted(draws) == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.5, 2.0])


def test_paired_runs_judge_auto_against_the_best_fixed_length_on_the_same_seeds(sim, tmp_path):
    """Off is best (speculation costs 2-5x a plain step for little acceptance): `auto` must find
    it; and the same seed with the best fixed length forced is the yardstick."""
    out = tmp_path / "sim.json"
    sim.main(["--costs", "10,20,30,40,50", "--cond", "0.3,0.3,0.3,0.3", "--steps", "400", "--seeds", "3",
              "--regime-every", "40", "--regime-spread", "0.3", "--paired", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["best_fixed"] == 0 and res["paired"] and len(res["auto_over_best"]) == 3
    assert 0.9 < res["mean"] <= 1.0 + 1e-9   # probes cost a little; nothing beats off here
    assert res["steps_by_length"]["0"] > 0.9 * 3 * 400


def test_a_fixed_run_is_the_length_it_is_given(sim):
    r = sim.simulate([1e-3, 1.5e-3], [0.8], 1, 200, 0, 0.1, fixed=1)
    assert r["depths"] == {1: 200}
    # tokens per step at a chain of 1 with acceptance 0.8: 1.8 on average
    assert 1.6 < r["tok_per_s"] * 1.5e-3 < 2.0


def test_a_served_policy_trace_gives_noise_draws(sim, tmp_path):
    """ADASPEC_POLICY_TRACE's file (what the policy observed in a served engine) feeds the same
    noise model: steady steps of one length over their median, probes and switches left out."""
    from adaspec.config import SpecConfig
    from adaspec.spec_decode.policy import AutoPolicy, StepFeedback
    from adaspec.spec_decode.policy_trace import PolicyTrace
    pol = AutoPolicy(SpecConfig(draft="x", policy="auto", num_steps=2))
    seen = []
    pol.observe = lambda fb, _o=pol.observe: seen.append(fb) or _o(fb)
    trace = PolicyTrace(pol)
    costs = [(2, 1.0), (2, 1.2), (2, 0.8), (0, 5.0), (0, 0.5), (0, 0.5), (2, 9.0), (2, 1.0)]
    for d, ms in costs:
        pol.observe(StepFeedback(batch_size=1, num_tokens=d + 1, draft_len=d, step_time=ms / 1e3,
                                 accepted_per_position=(1,) * d, drafted_per_position=(1,) * d))
    pol.probes.append((2, True))   # an auto probe: recorded as one, and left out of the noise
    pol.observe(StepFeedback(batch_size=1, num_tokens=3, draft_len=2, step_time=7e-3,
                             accepted_per_position=(1, 0), drafted_per_position=(1, 1)))
    assert len(seen) == len(costs) + 1   # the policy still observes every step
    path = tmp_path / "t.123.jsonl"
    trace.write(str(path))
    head, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert head == {"policy": "auto", "num_steps": 2, "topk": 1}
    assert rows[0] == [1, 2, 1000.0, 0, [1, 1], [1, 1], False, 3] and rows[-1][6] is True
    # steady: (2: 1.2, 0.8, 1.0) and (0: 0.5, 0.5); the first of each run and the probe are left out
    assert sorted(sim.noise_draws(str(path))) == pytest.approx([0.8, 1.0, 1.0, 1.0, 1.2])
