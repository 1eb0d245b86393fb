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
`--regime-every N --regime-spread S`: every N steps a new request, whose acceptance is the
rates times a factor from U(1 - S, 1 + S) (served prompts differ: 2.4-3.5 tokens per step).
`--paired`: each seed judged against the best fixed length run on the same seed (same
requests and host draws), where per-request acceptance makes the expected rate a loose yardstick.
`--noise-from TRACE`: the noise factors are drawn from a device's measured steps instead
(`step_cost_trace.py`). `--profile`: the start-up profile's figures, where they differ from served steps (on the H200
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


def expected_rate(costs: list[float], cond: list[float], b: int, noise: float, spike: float = 1.0,
                  regime_spread: float = 0.0) -> dict[int, float]:
    """Expected tokens per second of each fixed draft length (mean step cost under the noise;
    `spike`: the mean factor of the host's hiccups; `regime_spread`: acceptance scaled per
    request, averaged over the factors' range)."""
    factors = [1 - regime_spread + 2 * regime_spread * (i + 0.5) / 100 for i in range(100)] if regime_spread else [1.0]
    out = {}
    for d in range(len(costs)):
        tau = statistics.mean(1 + sum(math.prod(scaled(cond, f)[: j + 1]) for j in range(d)) for f in factors)
        out[d] = b * tau / (costs[d] * spike)
    return out


def scaled(cond: list[float], f: float) -> list[float]:
    """The conditional acceptance of a request whose drafts suit it `f` times as well."""
    return [min(0.98, c * f) for c in cond]


def simulate(costs: list[float], cond: list[float], b: int, steps: int, seed: int, noise: float,
             drift: float = 0.0, period: int = 0, spike_rate: float = 0.0, spike_factor: float = 1.0,
             profile: list[float] | None = None, noise_draws: list[float] | None = None,
             regime_every: int = 0, regime_spread: float = 0.0, fixed: int | None = None, **policy) -> dict:
    attrs = {k: policy.pop(k) for k in ("thin", "quantile", "table_tolerance") if k in policy}
    pol = AutoPolicy(SpecConfig(draft="sim", num_steps=len(costs) - 1), **policy)
    for k, v in attrs.items():   # class constants, set on this instance
        setattr(pol, "THIN_EVIDENCE" if k == "thin" else k.upper(), v)
    for d, t in enumerate(profile or costs):   # the start-up profile's figures
        key = (d, pol.bucket(b))
        pol._sample(key, t)
        pol.profiled.add(key)
    rng, host_rng, spike_rng = random.Random(seed), random.Random(seed + 10 ** 6), random.Random(seed + 2 * 10 ** 6)
    regime_rng, now = random.Random(seed + 3 * 10 ** 6), cond
    tokens, seconds, depths = 0, 0.0, Counter()
    host, host_sum = 1.0, 0.0
    for i in range(steps):
        if drift and period and i % period == 0:
            host = host_rng.uniform(1 - drift, 1 + drift)
        host_sum += host
        if regime_every and i % regime_every == 0:   # the next request: its own acceptance
            now = scaled(cond, regime_rng.uniform(1 - regime_spread, 1 + regime_spread))
        shape = pol.decide(b, 0) if fixed is None else pol.shapes[fixed]
        d = 0 if shape is None else shape.num_steps
        accepted = [0] * d
        for _r in range(b):
            k = 0
            while k < d and rng.random() < now[k]:
                k += 1
            for j in range(k):
                accepted[j] += 1
            tokens += k + 1
        t = costs[d] * host * (rng.choice(noise_draws) if noise_draws else rng.uniform(1 - noise, 1 + noise))
        if spike_rate and spike_rng.random() < spike_rate:
            t *= spike_factor
        seconds += t
        depths[d] += 1
        if fixed is None:
            pol.observe(StepFeedback(batch_size=b, num_tokens=b * (d + 1), draft_len=d, step_time=t,
                                     accepted_per_position=tuple(accepted), drafted_per_position=(b,) * d))
    return {"tok_per_s": tokens / seconds, "depths": dict(sorted(depths.items())), "mean_host": host_sum / steps}


def noise_draws(path: str) -> list[float]:
    """Multiplicative noise factors measured on a device: every steady step (no prompt rows,
    batch 1, not the first of its run) over the median of its length's such steps. `path`: a
    `step_cost_trace.py` JSON (call 2 of session 14 on the H200: 5th / 50th / 95th / 99th
    percentiles 0.89 / 1.00 / 1.44 / 1.67, the largest 2.78: a tail uniform noise lacks), or a
    served engine's ADASPEC_POLICY_TRACE file (spec_decode/policy_trace.py; probe steps left out)."""
    with open(path) as f:
        first = f.readline()
        if path.endswith(".jsonl"):   # [batch, length, us, prompt rows, accepted, drafted, probe] per step
            rows = [json.loads(line) for line in f if line.strip()]
            steps = [(r[1], r[2]) for prev, r in zip(rows, rows[1:])
                     if r[0] == 1 and r[3] == 0 and not r[6] and prev[1] == r[1]]
        else:
            recs = json.loads(first + f.read())["records"]
            steps = [(r["decided"], r["cost_ms"]) for r in recs
                     if r["prefill"] == 0 and r["batch"] == 1 and r["pos"] >= 2]
    by: dict[int, list[float]] = {}
    for d, c in steps:
        by.setdefault(d, []).append(c)
    med = {d: statistics.median(x) for d, x in by.items()}
    return [c / med[d] for d, c in steps]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", required=True, help="ms per step at draft lengths 0..K")
    ap.add_argument("--cond", required=True, help="conditional acceptance of draft positions 1..K")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--noise", type=float, default=0.05, help="step costs vary by +- this fraction")
    ap.add_argument("--ema", type=float, default=None)
    ap.add_argument("--margin", type=float, default=None, help="AutoPolicy's margin (a choice is kept unless beaten by it)")
    ap.add_argument("--probe-every", type=int, default=None)
    ap.add_argument("--thin", type=int, default=None, help="AutoPolicy.THIN_EVIDENCE")
    ap.add_argument("--quantile", type=float, default=None, help="AutoPolicy.QUANTILE (0: a window's fastest step)")
    ap.add_argument("--table-tolerance", type=float, default=None, help="AutoPolicy.TABLE_TOLERANCE")
    ap.add_argument("--drift", type=float, default=0.0, help="the host's speed factor range, +- this fraction")
    ap.add_argument("--drift-period", type=int, default=0, help="steps between the host's speed changes")
    ap.add_argument("--spike-rate", type=float, default=0.0, help="chance that a step is a host hiccup")
    ap.add_argument("--spike-factor", type=float, default=2.0, help="a hiccup's step costs this many times its figure")
    ap.add_argument("--profile", default=None, help="the start-up profile's ms per length (default: --costs)")
    ap.add_argument("--regime-every", type=int, default=0,
                    help="steps per request: each request's acceptance is the rates times its own factor")
    ap.add_argument("--regime-spread", type=float, default=0.0, help="that factor is drawn from U(1 - S, 1 + S)")
    ap.add_argument("--noise-from", default=None,
                    help="a benchmarks/step_cost_trace.py JSON: each step's noise factor is drawn from its "
                         "steps' costs over their length's median (instead of --noise)")
    ap.add_argument("--paired", action="store_true",
                    help="judge each seed against the best fixed length run on the same seed (the same requests "
                         "and host), not against its expected rate")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    costs = [float(x) / 1e3 for x in a.costs.split(",")]
    cond = [float(x) for x in a.cond.split(",")]
    if len(cond) != len(costs) - 1:
        raise SystemExit(f"--cond needs {len(costs) - 1} rates (one per draft position), got {len(cond)}")
    policy = {k: v for k, v in (("ema", a.ema), ("margin", a.margin), ("probe_every", a.probe_every),
                                                ("thin", a.thin), ("quantile", a.quantile),
                                                ("table_tolerance", a.table_tolerance)) if v is not None}
    profile = [float(x) / 1e3 for x in a.profile.split(",")] if a.profile else None
    if profile is not None and len(profile) != len(costs):
        raise SystemExit(f"--profile needs {len(costs)} figures, got {len(profile)}")
    draws = noise_draws(a.noise_from) if a.noise_from else None
    mean_noise = statistics.mean(draws) if draws else 1.0
    fixed = expected_rate(costs, cond, a.batch, a.noise, mean_noise * (1 + a.spike_rate * (a.spike_factor - 1)),
                          a.regime_spread if a.regime_every else 0.0)
    best_d = max(fixed, key=fixed.get)
    runs = [simulate(costs, cond, a.batch, a.steps, s, a.noise, a.drift, a.drift_period, a.spike_rate, a.spike_factor,
                     profile, draws, a.regime_every, a.regime_spread, **dict(policy)) for s in range(a.seeds)]
    if a.paired:
        twins = [simulate(costs, cond, a.batch, a.steps, s, a.noise, a.drift, a.drift_period, a.spike_rate,
                          a.spike_factor, profile, draws, a.regime_every, a.regime_spread, fixed=best_d)
                 for s in range(a.seeds)]
        ratios = [r["tok_per_s"] / f["tok_per_s"] for r, f in zip(runs, twins)]
    else:
        ratios = [r["tok_per_s"] * r["mean_host"] / fixed[best_d] for r in runs]
    spread = Counter()
    for r in runs:
        spread.update(r["depths"])
    res = {"costs_ms": [c * 1e3 for c in costs], "cond": cond, "batch": a.batch, "steps": a.steps, "seeds": a.seeds,
           "noise": a.noise, "drift": a.drift, "drift_period": a.drift_period, "spike_rate": a.spike_rate,
           "spike_factor": a.spike_factor, "profile_ms": a.profile, "noise_from": a.noise_from,
           "regime_every": a.regime_every, "regime_spread": a.regime_spread, "paired": a.paired, "policy": policy, "fixed_tok_per_ms": {d: v / 1e3 for d, v in fixed.items()},
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
