"""The `auto` policy against the best fixed draft length, in simulation (CPU, seconds): the real
AutoPolicy fed step costs and acceptance drawn from given figures, as the engine feeds it.

    python3 benchmarks/auto_sim.py --costs 0.70,1.50,1.55,1.58,1.60 --cond 0.693,0.755,0.612,0.787 \
        --seeds 40 --steps 1200 --out auto_sim.json

`--costs` are ms per step at draft lengths 0..K (batch `--batch`); `--cond` the chance that
draft position j is accepted when position j - 1 was (a chain). Each simulated step costs its
length's figure times U(1 - noise, 1 + noise) and emits 1 + the accepted drafts (per request);
the start-up profile is seeded with the exact costs, as `auto`'s profile seeds it. Printed and
written: tokens per ms of `auto` per seed over the expected tokens per ms of the best fixed
length (same noise model, so 1.0 is reachable), its mean and worst seed, and how its steps were
spread over the lengths. `--ema` / `--probe-every` / `--thin` vary the policy's parameters.
`--drift A --drift-period P`: the host's speed moves too, every length's cost times a factor
drawn from U(1 - A, 1 + A) every P steps (the H200 host: +-25% from one minute to the next, seen
as `auto` pricing lengths timed in different minutes against each other); the best fixed length
is then judged at the run's mean factor. `--spike-rate p --spike-factor f`: a step is a hiccup
of the host (a collection, a page fault) with chance p and costs f times its figure.
`--profile`: the start-up profile's figures, where they differ from served steps (on the H200
the profile times launches alone: 0.24-0.63 ms for lengths 0-8 of the demo pair, served steps
0.8-1.1 ms at every length).
The figures of session 9's demo pair: `results/h200/session9_2026-12-03/` (call 4, server log).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections import Counter

from adaspec.config import SpecConfig
from adaspec.spec_decode.policy import AutoPolicy, StepFeedback


def expected_rate(costs: list[float], cond: list[float], b: int, noise: float, spike: float = 1.0) -> dict[int, float]:
    """Expected tokens per second of each fixed draft length (mean step cost under the noise;
    `spike`: the mean factor of the host's hiccups)."""
    return {d: b * (1 + sum(math.prod(cond[: j + 1]) for j in range(d))) / (costs[d] * spike) for d in range(len(costs))}


def simulate(costs: list[float], cond: list[float], b: int, steps: int, seed: int, noise: float,
             drift: float = 0.0, period: int = 0, spike_rate: float = 0.0, spike_factor: float = 1.0,
             profile: list[float] | None = None, **policy) -> dict:
    thin = policy.pop("thin", None)
    pol = AutoPolicy(SpecConfig(draft="sim", num_steps=len(costs) - 1), **policy)
    if thin is not None:
        pol.THIN_EVIDENCE = thin
    for d, t in enumerate(profile or costs):   # the start-up profile's figures
        key = (d, pol.bucket(b))
        pol._sample(key, t)
        pol.profiled.add(key)
    rng, host_rng, spike_rng = random.Random(seed), random.Random(seed + 10 ** 6), random.Random(seed + 2 * 10 ** 6)
    tokens, seconds, depths = 0, 0.0, Counter()
    host, host_sum = 1.0, 0.0
    for i in range(steps):
        if drift and period and i % period == 0:
            host = host_rng.uniform(1 - drift, 1 + drift)
        host_sum += host
        shape = pol.decide(b, 0)
        d = 0 if shape is None else shape.num_steps
        accepted = [0] * d
        for _r in range(b):
            k = 0
            while k < d and rng.random() < cond[k]:
                k += 1
            for j in range(k):
                accepted[j] += 1
            tokens += k + 1
        t = costs[d] * host * rng.uniform(1 - noise, 1 + noise)
        if spike_rate and spike_rng.random() < spike_rate:
            t *= spike_factor
        seconds += t
        depths[d] += 1
        pol.observe(StepFeedback(batch_size=b, num_tokens=b * (d + 1), draft_len=d, step_time=t,
                                 accepted_per_position=tuple(accepted), drafted_per_position=(b,) * d))
    return {"tok_per_s": tokens / seconds, "depths": dict(sorted(depths.items())), "mean_host": host_sum / steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", required=True, help="ms per step at draft lengths 0..K")
    ap.add_argument("--cond", required=True, help="conditional acceptance of draft positions 1..K")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--noise", type=float, default=0.05, help="step costs vary by +- this fraction")
    ap.add_argument("--ema", type=float, default=None)
    ap.add_argument("--probe-every", type=int, default=None)
    ap.add_argument("--thin", type=int, default=None, help="AutoPolicy.THIN_EVIDENCE")
    ap.add_argument("--drift", type=float, default=0.0, help="the host's speed factor range, +- this fraction")
    ap.add_argument("--drift-period", type=int, default=0, help="steps between the host's speed changes")
    ap.add_argument("--spike-rate", type=float, default=0.0, help="chance that a step is a host hiccup")
    ap.add_argument("--spike-factor", type=float, default=2.0, help="a hiccup's step costs this many times its figure")
    ap.add_argument("--profile", default=None, help="the start-up profile's ms per length (default: --costs)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    costs = [float(x) / 1e3 for x in a.costs.split(",")]
    cond = [float(x) for x in a.cond.split(",")]
    if len(cond) != len(costs) - 1:
        raise SystemExit(f"--cond needs {len(costs) - 1} rates (one per draft position), got {len(cond)}")
    policy = {k: v for k, v in (("ema", a.ema), ("probe_every", a.probe_every), ("thin", a.thin)) if v is not None}
    profile = [float(x) / 1e3 for x in a.profile.split(",")] if a.profile else None
    if profile is not None and len(profile) != len(costs):
        raise SystemExit(f"--profile needs {len(costs)} figures, got {len(profile)}")
    fixed = expected_rate(costs, cond, a.batch, a.noise, 1 + a.spike_rate * (a.spike_factor - 1))
    best_d = max(fixed, key=fixed.get)
    runs = [simulate(costs, cond, a.batch, a.steps, s, a.noise, a.drift, a.drift_period, a.spike_rate, a.spike_factor,
                     profile, **dict(policy)) for s in range(a.seeds)]
    ratios = [r["tok_per_s"] * r["mean_host"] / fixed[best_d] for r in runs]
    spread = Counter()
    for r in runs:
        spread.update(r["depths"])
    res = {"costs_ms": [c * 1e3 for c in costs], "cond": cond, "batch": a.batch, "steps": a.steps, "seeds": a.seeds,
           "noise": a.noise, "drift": a.drift, "drift_period": a.drift_period, "spike_rate": a.spike_rate,
           "spike_factor": a.spike_factor, "profile_ms": a.profile, "policy": policy, "fixed_tok_per_ms": {d: v / 1e3 for d, v in fixed.items()},
           "best_fixed": best_d, "auto_over_best": ratios, "mean": statistics.mean(ratios), "worst": min(ratios),
           "steps_by_length": dict(sorted(spread.items()))}
    print(f"best fixed: length {best_d} ({fixed[best_d] / 1e3:.3f} tok/ms; off {fixed[0] / 1e3:.3f})")
    print(f"auto / best fixed over {a.seeds} seeds: mean {res['mean']:.3f}, worst {res['worst']:.3f}; "
          f"steps by length {res['steps_by_length']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
