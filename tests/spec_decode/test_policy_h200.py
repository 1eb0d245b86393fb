"""The `auto` policy on the H200's cost table (issue 10), on the CPU.

`tests/data/h200_cost_table.json` holds whole-step times per (batch size, draft shape) of the
Llama-3.1-8B shape on one H200: the step times recorded by the fast-path run where they exist,
the rest derived from that run's physics probe (the file says which is which and how; the
first test recomputes every cell). The policy gets the table through its real interfaces
(`warm_up` with a profiling callable, and/or `observe` with each step's time from the table)
and a simulated acceptance of 0.8 per position, as the engine's simulated verifier applies it:
each draft level is reached with probability 0.8 given the one before (for a tree: its first
child, which is how the policy models trees too, by depth level). Contracts:
  (a) the chosen depth falls with batch size (non-increasing, > 0 at b=1, smaller at 256);
  (b) the choice is never slower, by the table and the true acceptance, than the best
      configuration by more than the policy's margin;
  (c) with acceptance ~0 the choice is off at every batch size;
  (d) once warm the choice is stable: the committed shape does not change, and the only other
      shape run is the one-level-deeper probe, a run of `PROBE_STEPS` steps at most once every
      `probe_every` steps.
Regenerate the data file from the benchmark results with `python tests/test_policy_h200.py`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from adaspec.config import SpecConfig
from adaspec.spec_decode.policy import AutoPolicy, StepFeedback

DATA = Path(__file__).parents[1] / "data" / "h200_cost_table.json"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200" / "fast_path"
TABLE = json.loads(DATA.read_text())
BATCHES = tuple(TABLE["batch_sizes"])
STEP = {name: dict(zip(BATCHES, ts)) for name, ts in TABLE["step_time_s"].items()}
CHAIN = dict(num_steps=4, topk=1)                         # depths 0..4: off, chain1..chain4
TREE = dict(num_steps=2, topk=4, num_draft_tokens=16)     # depths 0..2: off, tree(s1,k4,n5), the 16-token tree
ACCEPT = 0.8
WARM, WINDOW = 300, 300   # steps before the choice is read; steps over which it is checked


# ---- the table: recorded numbers and the derivation of the others ------------------------------

def lerp(x, xs, ys):
    """Piecewise-linear through (xs, ys); constant beyond either end."""
    if x <= xs[0]:
        return ys[0]
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


# Rows: shape -> (its draft levels, tokens verified per request q, recorded shape of its kind, that one's levels).
ROWS = {"off": (0, 1, "chain3", 3), **{f"chain{d}": (d, d + 1, "chain3", 3) for d in range(1, 5)},
           "tree(s1,k4,n5)": (1, 5, "tree(s2,k4,n16)", 2), "tree(s2,k4,n16)": (2, 16, "tree(s2,k4,n16)", 2)}
RECORDED_Q = {"off": 1, "chain3": 4, "tree(s2,k4,n16)": 16}


def derive_table(physics_ms: dict, recorded_ms: dict) -> dict:
    """{shape: [seconds per batch size]} from the physics probe T(b, q) and the recorded steps:
    step = T(b, q) * rho, rho = recorded step / T, linear in draft levels between off and the
    recorded shape of the same kind, piecewise-linear in b, held beyond the last recorded b."""
    pb = sorted({int(k.split("x")[0]) for k in physics_ms})
    pq = sorted({int(k.split("x")[1]) for k in physics_ms})

    def T(b, q):
        return lerp(b, pb, [lerp(q, pq, [physics_ms[f"{bb}x{qq}"] for qq in pq]) for bb in pb])

    def rho(name, b):
        pts = sorted(int(x) for x in recorded_ms[name])
        return lerp(b, pts, [recorded_ms[name][str(x)] / physics_ms[f"{x}x{RECORDED_Q[name]}"] for x in pts])

    out = {}
    for name, (levels, q, ref, ref_levels) in ROWS.items():
        out[name] = [round(T(b, q) * (rho("off", b) + (rho(ref, b) - rho("off", b)) * levels / ref_levels) / 1000, 7)
                     for b in BATCHES]
    return out


def test_table_is_the_recorded_run_and_its_stated_derivation():
    src = TABLE["source"]
    assert derive_table(src["physics_T_ms"], src["recorded_step_ms"]) == TABLE["step_time_s"]
    for name, cells in src["recorded_step_ms"].items():      # recorded cells come back exactly
        for b, ms in cells.items():
            assert STEP[name][int(b)] == pytest.approx(ms / 1000, abs=1e-7)
    if not (RESULTS / "fast_path.json").exists():
        pytest.skip("benchmark results not in this checkout")
    steps = json.loads((RESULTS / "fast_path.json").read_text())["steps"]
    key = {"off": "off", "chain3": "chain3", "tree(s2,k4,n16)": "tree16"}
    for name, cells in src["recorded_step_ms"].items():
        for b, ms in cells.items():
            assert ms == round(steps[f"{key[name]}:b{b}"]["step_ms"], 3)
    assert src["physics_T_ms"] == json.loads((RESULTS / "physics.json").read_text())["T_ms"]


# ---- driving the policy ---------------------------------------------------------------------

def policy(shape=CHAIN, profile=True) -> AutoPolicy:
    pol = AutoPolicy(SpecConfig(draft="x", policy="auto", auto_profile=profile, **shape))
    pol.warm_up(lambda shapes: {(b, d): STEP[row(s)][b] for d, s in enumerate(shapes) for b in BATCHES})
    return pol


def row(shape) -> str:
    return str(shape) if shape is not None else "off"


def levels(shape) -> int:
    return shape.num_steps if shape is not None else 0


def true_goodputs(pol: AutoPolicy, b: int, rate: float) -> dict[int, float]:
    """Expected tokens per request per second of each depth the policy can run, by the table:
    (1 + expected accepted drafts) / step time; level i+1 is reached with probability rate**(i+1)."""
    return {d: (1 + sum(rate ** (i + 1) for i in range(levels(s)))) / STEP[row(s)][b]
            for d, s in enumerate(pol.shapes)}


def run(pol: AutoPolicy, b: int, steps: int, rate: float, rng=None) -> list[tuple[int, int]]:
    """`steps` engine steps at batch b: decide, then observe the table's step time and the
    acceptance (expected counts; with `rng`, sampled per request like the simulated verifier).
    Returns (depth run, depth committed) per step, and checks at every step that the committed
    depth is within the margin of the best by the policy's own estimates (once it has any)."""
    out = []
    for _ in range(steps):
        shape = pol.decide(b)
        d = levels(shape)
        g, committed = pol.last_goodputs, pol.depth
        assert not g or g[committed] * (1 + pol.margin) >= max(g.values()), (b, committed, g)
        if rng is None:
            acc = tuple(b * rate ** (i + 1) for i in range(d))
        else:
            reach, acc = b, []
            for _ in range(d):
                reach = int(rng.binomial(reach, rate))
                acc.append(reach)
            acc = tuple(acc)
        nodes = shape.num_nodes if shape is not None else 0
        pol.observe(StepFeedback(batch_size=b, num_tokens=b * (nodes + 1), draft_len=nodes,
                                 step_time=STEP[row(shape)][b], accepted_per_position=acc,
                                 drafted_per_position=(b,) * d))
        out.append((d, committed))
    return out


def settled_choice(pol: AutoPolicy, b: int, rate: float) -> int:
    """Warm the policy at batch b, then check (d) over a window and return the committed depth."""
    run(pol, b, WARM, rate)
    trace = run(pol, b, WINDOW, rate)
    committed = {c for _, c in trace}
    assert len(committed) == 1, (b, committed)                       # (d) no change once warm
    (c,) = committed
    probes = [i for i, (d, _) in enumerate(trace) if d != c]
    assert all(trace[i][0] == c + 1 for i in probes), (b, c, trace)  # only the one-deeper probe
    runs = [i for i in probes if i - 1 not in probes]                # ... in runs of PROBE_STEPS
    assert all(i + k in probes for i in runs[:-1] for k in range(pol.PROBE_STEPS)), (b, probes)
    assert len(probes) <= len(runs) * pol.PROBE_STEPS, (b, probes)
    assert all(j - i >= pol.probe_every for i, j in zip(runs, runs[1:])), (b, runs)
    assert len(runs) <= WINDOW // pol.probe_every + 1
    return c


def within_margin(pol, b, depth, rate=ACCEPT) -> bool:
    g = true_goodputs(pol, b, rate)
    return g[depth] * (1 + pol.margin) >= max(g.values())


# ---- contracts -------------------------------------------------------------------------------

def test_depth_falls_with_batch_size_and_stays_within_margin_of_the_best():
    chosen = {b: settled_choice(policy(), b, ACCEPT) for b in BATCHES}
    print("auto, chain <= 4, acceptance 0.8, H200 table: depth per batch size", chosen)
    depths = [chosen[b] for b in BATCHES]
    assert depths == sorted(depths, reverse=True), chosen                        # (a)
    assert depths[0] > 0 and depths[-1] < depths[0], chosen
    for b in BATCHES:                                                            # (b)
        assert within_margin(policy(), b, chosen[b]), (b, chosen[b], true_goodputs(policy(), b, ACCEPT))


def test_tree_shape_never_picks_what_its_table_says_is_slower():
    """The 16-token tree loses to plain decoding at every batch size on this table (the
    tree drafter's host work); its one-level cut wins only near b=16. Same contracts."""
    chosen = {b: settled_choice(policy(TREE), b, ACCEPT) for b in BATCHES}
    print("auto, tree(s2,k4,n16), acceptance 0.8, H200 table: depth per batch size", chosen)
    for b in BATCHES:
        assert within_margin(policy(TREE), b, chosen[b]), (b, chosen[b])
    assert 2 not in chosen.values()


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_no_acceptance_means_off_at_every_batch_size(shape):
    for b in BATCHES:                                                            # (c)
        pol = policy(shape)
        assert settled_choice(pol, b, 0.01) == 0, b


def test_load_ramp_up_and_down():
    """One policy through a load ramp 1 -> 256 -> 1: at every level the choice is within the
    margin of the best; it never deepens while load rises nor gets shallower while it falls
    (the margin may keep a choice a little past the crossover, in both directions)."""
    pol = policy()
    up = [settled_choice(pol, b, ACCEPT) for b in BATCHES]
    down = [settled_choice(pol, b, ACCEPT) for b in reversed(BATCHES)]
    print("load ramp, depth up:", up, "down:", down)
    for b, d in zip(BATCHES + BATCHES[::-1], up + down):
        assert within_margin(pol, b, d), (b, d)
    assert up == sorted(up, reverse=True) and down == sorted(down), (up, down)
    assert up[0] > up[-1] and down[-1] > down[0]


def test_cost_table_learned_from_observation_alone():
    """No start-up profile (auto_profile=False): the table holds only what steps ran. The
    policy must still reach the same contracts, because probing a depth it has never timed is
    how it learns that depth's cost (a policy that only probes timed depths never leaves off)."""
    chosen = {}
    for b in BATCHES:
        pol = policy(profile=False)
        assert not pol.times
        run(pol, b, 5 * pol.probe_every, ACCEPT)    # one level per probe: 4 levels to climb
        chosen[b] = settled_choice(pol, b, ACCEPT)
        assert within_margin(pol, b, chosen[b]), (b, chosen[b])
    print("no profile: depth per batch size", chosen)
    depths = [chosen[b] for b in BATCHES]
    assert depths == sorted(depths, reverse=True) and depths[0] > 0 and depths[-1] < depths[0], chosen


def test_sampled_acceptance_keeps_most_of_the_goodput():
    """Acceptance sampled per request (binomial per level, as the simulated verifier draws it)
    rather than expected counts. The acceptance EMA remembers about a dozen request
    verifications (one step, at large batches), so at small batches its noise exceeds the 5%
    margin and the choice wanders between neighbouring depths (at b <= 4 the realized goodput
    is 85-95% of the best, depending on the seed): the bound here is looser (80% of the best) than the noiseless one,
    and the committed depth must never flap back and forth on consecutive steps."""
    rng = np.random.default_rng(0)
    for b in BATCHES:
        pol = policy()
        run(pol, b, WARM, ACCEPT, rng)
        trace = run(pol, b, 1000, ACCEPT, rng)
        g = true_goodputs(pol, b, ACCEPT)
        realized = sum(g[d] for d, _ in trace) / len(trace)
        assert realized >= 0.8 * max(g.values()), (b, realized / max(g.values()))
        c = [c for _, c in trace]
        assert not any(c[i] == c[i - 2] != c[i - 1] for i in range(2, len(c))), b


# ---- regenerating the data file ----------------------------------------------------------------

def _one_line(m) -> str:
    return " ".join(m.group(0).split()).replace("[ ", "[").replace(" ]", "]").replace("{ ", "{").replace(" }", "}")


def _write_table() -> None:
    """Rebuild tests/data/h200_cost_table.json from benchmarks/results/h200/fast_path."""
    steps = json.loads((RESULTS / "fast_path.json").read_text())["steps"]
    physics = json.loads((RESULTS / "physics.json").read_text())["T_ms"]
    recorded = {name: {str(b): round(steps[f"{key}:b{b}"]["step_ms"], 3) for b in bs}
                for name, key, bs in (("off", "off", (1, 16, 64, 256)), ("chain3", "chain3", (1, 16, 64)),
                                      ("tree(s2,k4,n16)", "tree16", (1, 16, 64)))}
    table = dict(TABLE)
    table["source"] = {**TABLE["source"], "recorded_step_ms": recorded, "physics_T_ms": physics}
    table["step_time_s"] = derive_table(physics, recorded)
    text = json.dumps(table, indent=1)
    # One line per row of numbers: collapse lists and flat dicts of numbers.
    text = re.sub(r"[\[{][^\[\]{}\"]*(?:\"[\dx]+\": [^\[\]{}\"]*)*[\]}]", _one_line, text)
    DATA.write_text(text + "\n")


if __name__ == "__main__":
    _write_table()
