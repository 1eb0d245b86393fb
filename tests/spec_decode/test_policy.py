"""Load-adaptive speculation: the threshold regression, draft-KV freshness, the auto
policy's choices, and per-request opt-out."""
from __future__ import annotations

import pytest

import random

import torch

from adaspec import LLM, SamplingParams
from adaspec.config import SpecConfig
from adaspec.spec_decode.policy import AutoPolicy, SpeculationPolicy, StepFeedback, ThresholdPolicy
from helpers import prompts_of_lengths

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def run_phases(engine, phases, prompts_iter, params):
    """Submit `c` requests at once for each phase c and drain them: the batch crosses the
    threshold every time c goes from <= N to > N and back."""
    outs = {}
    for phase, c in enumerate(phases):
        for j in range(c):
            prompt = next(prompts_iter)
            engine.add_request(f"p{phase}-{j}", prompt, params)
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
    return outs


@pytest.mark.slow
def test_threshold_crossings_regression(agree_dir, trained_head):
    """The crash that started the project: threshold 5 and 1, 2, 5, 10, 5, 1 concurrent
    requests, twice over. No error, same tokens as speculation off, both kinds of step, KV back."""
    phases = [1, 2, 5, 10, 5, 1] * 2
    prompts = prompts_of_lengths([3 + (i * 7) % 23 for i in range(sum(phases))], seed=21)
    off = LLM(agree_dir, device="cpu", dtype="float32", block_size=4).engine
    ref = run_phases(off, phases, iter(prompts), GREEDY)
    llm = LLM(agree_dir, draft=trained_head, speculation="threshold", spec_disable_batch_size=5,
              num_steps=3, device="cpu", dtype="float32", block_size=4)
    eng = llm.engine
    start_free = eng.num_free_blocks
    got = run_phases(eng, phases, iter(prompts), GREEDY)
    assert got == ref
    st = llm.stats()
    assert st["spec_steps"] > 0 and st["nonspec_steps"] > 0
    assert set(st["draft_len_histogram"]) >= {0, 3}
    assert st["accepted_tokens"] > 0
    assert eng.num_free_blocks == start_free == eng.num_total_blocks
    print("threshold scenario stats:", {k: st[k] for k in (
        "spec_steps", "nonspec_steps", "draft_len_histogram", "verify_steps", "accept_length",
        "accept_rate_per_position", "num_free_blocks", "num_total_blocks")})


def test_threshold_hysteresis_does_not_flap():
    pol = ThresholdPolicy(SpecConfig(draft="x", policy="threshold", spec_disable_batch_size=8))
    seq = [7, 8, 9, 8, 9, 7, 8, 6, 5, 6, 9]
    on = [pol.decide(b) is not None for b in seq]
    assert on == [True, True, False, False, False, False, False, True, True, True, False]


class ForcedOff(SpeculationPolicy):
    """Wraps a policy; says 0 while `off` is set (a test's stand-in for high load)."""
    name = "forced"

    def __init__(self, inner):
        super().__init__(inner.cfg)
        self.inner, self.off = inner, False

    def decide(self, batch_size):
        return None if self.off else self.inner.decide(batch_size)


def accept_after(engine, prompt, n_tokens, off_range=None):
    """Generate greedily; return (tokens, acceptance length over verify steps that started
    at or after the end of `off_range`, in generated-token indices)."""
    pol = ForcedOff(engine.policy)
    engine.scheduler.policy = pol
    engine.add_request("fresh", prompt, SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True))
    measure_from = off_range[1] if off_range else 2 * n_tokens // 3
    base = None
    while engine.has_unfinished():
        done = len(engine.requests["fresh"].output_token_ids) if "fresh" in engine.requests else n_tokens
        pol.off = off_range is not None and off_range[0] <= done < off_range[1]
        if base is None and done >= measure_from:
            base = dict(engine.requests["fresh"].spec_stats.as_dict())
        for o in engine.step():
            final = o
    spec = final.spec
    steps = spec["verify_steps"] - base["verify_steps"]
    accepted = spec["accepted_tokens"] - base["accepted_tokens"]
    return final.token_ids, (steps + accepted) / steps, steps


@pytest.mark.slow
def test_draft_stays_fresh_through_an_off_period(agree_dir, trained_head, monkeypatch):
    """Acceptance on the last third of a request whose middle third ran without speculation
    equals that of an uninterrupted request (its draft caught up when speculation resumed).
    The same measurement with the catch-up's refresh dropped (the draft left stale, as
    engines without a catch-up leave it) must show the collapse (the test can fail)."""
    n = 90
    prompts = prompts_of_lengths([7, 12, 5], seed=22)

    def measure(off):
        rows = []
        for p in prompts:
            llm = LLM(agree_dir, draft=trained_head, speculation="always", num_steps=3, device="cpu",
                      dtype="float32")
            # Recycled memory: whatever a slot held before. A fresh draft never reads it.
            g = torch.Generator().manual_seed(0)
            for t in (t for kv in llm.engine.runner.draft_cache for t in kv):
                t.copy_(torch.randn(t.shape, generator=g) * 3)
            rows.append(accept_after(llm.engine, p, n, off))
        toks = [r[0] for r in rows]
        steps = sum(r[2] for r in rows)
        acc = sum(r[1] * r[2] for r in rows) / steps
        return toks, acc

    toks_a, uninterrupted = measure(None)
    toks_b, interrupted = measure((n // 3, 2 * n // 3))
    assert toks_a == toks_b
    assert uninterrupted > 1.3
    assert abs(interrupted - uninterrupted) < 0.15 * uninterrupted, (interrupted, uninterrupted)

    # Sensitivity check: a stale draft (the peers' bug) loses acceptance measurably.
    from adaspec.engine import runner as runner_mod
    original = runner_mod.refresh_entries

    def stale(sched, lay, *rest):
        keep = [i for i, s in enumerate(sched) if s.draft is not None or s.num_new_tokens > 1]
        return original([sched[i] for i in keep], [lay[i] for i in keep], *rest)
    monkeypatch.setattr(runner_mod, "refresh_entries", stale)
    _, stale_acc = measure((n // 3, 2 * n // 3))
    assert stale_acc < interrupted - 0.1, (stale_acc, interrupted)


def test_per_request_opt_out(agree_dir, trained_head):
    prompts = prompts_of_lengths([6, 9, 13, 4], seed=23)
    ref = LLM(agree_dir, device="cpu", dtype="float32").generate(prompts, GREEDY)
    llm = LLM(agree_dir, draft=trained_head, speculation="always", num_steps=3, device="cpu", dtype="float32")
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculate=(i % 2 == 0))
              for i in range(4)]
    params[2] = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, max_draft_tokens=1)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert outs[1].spec["draft_tokens"] == outs[3].spec["draft_tokens"] == 0
    assert outs[0].spec["draft_tokens"] > 0
    assert outs[2].spec["verify_steps"] > 0 and len(outs[2].spec["accept_rate_per_position"]) == 1


# ---- auto ----------------------------------------------------------------------------------

def feed(pol, b, times, rate, steps=30):
    """Feed `steps` synthetic steps at batch b for each depth: step time times(d), each draft
    position reached with probability rate**(i+1) (deterministic counts)."""
    for _ in range(steps):
        for d in range(pol.max_depth + 1):
            drafted = tuple([100 * b] * d)
            accepted = tuple(round(100 * b * rate ** (i + 1)) for i in range(d))
            pol.observe(StepFeedback(batch_size=b, num_tokens=b * (d + 1), draft_len=d, step_time=times(d),
                                     accepted_per_position=accepted, drafted_per_position=drafted))


def depth_of(shape):
    return shape.num_nodes if shape is not None else 0


def auto_policy(k=4):
    return AutoPolicy(SpecConfig(draft="x", policy="auto", num_steps=k, topk=1, auto_profile=False))


def test_auto_picks_zero_when_speculation_is_expensive():
    pol = auto_policy()
    feed(pol, 64, lambda d: 0.010 * (1 + 1.5 * d), rate=0.8)
    assert pol.decide(64) is None


def test_auto_picks_the_longest_when_speculation_is_cheap():
    pol = auto_policy()
    feed(pol, 16, lambda d: 0.005 * (1 + 0.02 * d), rate=0.8)
    assert pol.decide(16).num_nodes == 4


def test_auto_follows_batch_size_and_acceptance_collapse():
    pol = auto_policy()
    # Physics-like table: flat while memory-bound, linear once compute-bound, plus drafting.
    def cost(b):
        return lambda d: max(0.005, 0.00004 * b * (d + 1)) + 0.0003 * d
    for b in (1, 8, 64, 256):
        feed(pol, b, cost(b), rate=0.8, steps=5)
    depths = [depth_of(pol.decide(b)) for b in (1, 8, 64, 256)]
    assert depths[0] == 4 and depths[-1] == 0 and depths == sorted(depths, reverse=True), depths
    # Acceptance collapses at batch 1: the choice must drop to 0 within a bounded number of steps.
    pol2 = auto_policy()
    feed(pol2, 1, cost(1), rate=0.8, steps=10)
    assert pol2.decide(1).num_nodes == 4
    for step in range(1, 200):
        shape = pol2.decide(1)
        d = shape.num_nodes if shape else 0
        pol2.observe(StepFeedback(batch_size=1, num_tokens=d + 1, draft_len=d, step_time=cost(1)(d),
                                  accepted_per_position=(0,) * d, drafted_per_position=(1,) * d))
        if d == 0:
            break
    assert d == 0 and step <= 40, step


def test_auto_logs_each_change_with_its_numbers(caplog):
    import logging
    pol = auto_policy()
    pol.LOG_EVERY_S = 0.0
    with caplog.at_level(logging.INFO, logger="adaspec.spec_decode"):
        feed(pol, 16, lambda d: 0.005 * (1 + 0.02 * d), rate=0.8)
        assert pol.decide(16).num_nodes == 4
        feed(pol, 64, lambda d: 0.010 * (1 + 1.5 * d), rate=0.8)
        assert pol.decide(64) is None
        pol.decide(64)                                    # no change: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("auto: draft length 0 -> 4 at batch size 16")
    assert lines[1].startswith("auto: draft length 4 -> 0 at batch size 64: expected tokens/s by draft length {0: ")
    assert "acceptance length {0: 1.0, 1: 1.8" in lines[1] and "step ms {0: 10.0, 1: 25.0" in lines[1]


def test_auto_does_not_oscillate_on_noise():
    import random
    rng = random.Random(0)
    pol = auto_policy(k=2)
    # Depth 1 and 0 nearly tie; noisy timings must not make the choice flap. (Counted after
    # the first 30 steps, where the probes that first measure each depth run.)
    switches, last = 0, None
    for step in range(400):
        shape = pol.decide(32)
        d = shape.num_nodes if shape else 0
        if last is not None and d != last and step >= 30:
            switches += 1
        last = d
        t = 0.010 * (1 + 0.8 * d) * (1 + rng.uniform(-0.05, 0.05))
        acc = tuple(1 if rng.random() < 0.8 else 0 for _ in range(d))
        pol.observe(StepFeedback(batch_size=32, num_tokens=32 * (d + 1), draft_len=d, step_time=t,
                                 accepted_per_position=tuple(32 * a for a in acc),
                                 drafted_per_position=(32,) * d))
    assert switches <= 8, switches


def test_auto_end_to_end_is_lossless(agree_dir, trained_head):
    prompts = prompts_of_lengths([5, 14, 9, 3, 22, 8], seed=24)
    ref = LLM(agree_dir, device="cpu", dtype="float32").generate(prompts, GREEDY)
    llm = LLM(agree_dir, draft=trained_head, speculation="auto", num_steps=3, device="cpu", dtype="float32")
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    st = llm.stats()
    assert st["policy"] == "auto" and sum(st["draft_len_histogram"].values()) == st["spec_steps"] + st["nonspec_steps"]
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_auto_probes_deeper_and_climbs_when_later_positions_accept_more():
    """Acceptance measured only at depth 1 (0.6) extrapolates pessimistically; the real
    conditional acceptance of later positions is 0.95. The deeper probe measures it and the
    choice climbs to the full depth; without probing it would stay at 1."""
    pol = auto_policy(k=4)
    cost = lambda d: 0.010 * (1 + 0.25 * d)  # noqa: E731
    for d in range(5):  # a profiled cost table, no acceptance yet
        pol.times[(d, pol.bucket(1))] = cost(d)
    pol.rates = [0.6, None, None, None]
    pol.depth = 1
    seen = set()
    for _ in range(2000):
        d = depth_of(pol.decide(1))
        seen.add(d)
        reach = [0.6 * 0.95 ** i for i in range(d)]  # P(position i+1 accepted)
        pol.observe(StepFeedback(batch_size=1, num_tokens=d + 1, draft_len=d, step_time=cost(d),
                                 accepted_per_position=tuple(round(1000 * r) for r in reach),
                                 drafted_per_position=(1000,) * d))
    assert pol.depth == 4 and 2 in seen, (pol.depth, seen)  # it probed depth 2, then climbed
    # The same start with probing disabled stays where the extrapolation put it.
    pol2 = auto_policy(k=4)
    pol2.probe_every = 10 ** 9
    for d in range(5):
        pol2.times[(d, pol2.bucket(1))] = cost(d)
    pol2.rates, pol2.depth = [0.6, None, None, None], 1
    for _ in range(200):
        pol2.decide(1)
    assert pol2.depth == 1


def test_auto_first_rejection_does_not_zero_the_estimate():
    """One rejected first draft is one sample, not a measured rate of zero: the prior is
    updated (EMA weight of one step), and speculation that pays on the prior goes on."""
    pol = auto_policy(k=2)
    for d in range(3):
        pol.times[(d, pol.bucket(1))] = 0.010 * (1 + 0.2 * d)
    assert depth_of(pol.decide(1)) > 0
    pol.observe(StepFeedback(batch_size=1, num_tokens=2, draft_len=1, step_time=0.012,
                             accepted_per_position=(0,), drafted_per_position=(1,)))
    assert 0.4 < pol.rates[0] < pol.prior_rate
    assert depth_of(pol.decide(1)) > 0


def test_auto_probe_timings_do_not_overwrite_the_cost_table():
    """A probe is a short run of a deeper draft between steps of the chosen depth. On the H200
    the step that switched depth was timed at 3x the steady cost of that depth, and three probes
    priced depth 3 out at batch 1 for good. A probe's acceptance counts; its first step's time
    only fills an empty entry; the run's later steps are samples, and replace an entry gone
    stale (a depth timed once when the host was slower kept its figure for good otherwise)."""
    pol = AutoPolicy(SpecConfig(draft="x", policy="auto", num_steps=4, topk=1, auto_profile=True))
    steady = {0: 0.00483, 1: 0.0055, 2: 0.00606, 3: 0.00624}      # seconds at b=1; depth 4 unknown
    pol.warm_up(lambda shapes: {(1, d): t for d, t in steady.items()})
    pol.rates[:2] = [0.8, 0.64]
    pol.evidence = [1000] * 4       # those rates as if measured on many tokens
    pol.depth = 2
    pol.steps_since_spec = pol.probe_every

    def step(d, t):
        pol.observe(StepFeedback(batch_size=1, num_tokens=d + 1, draft_len=d, step_time=t,
                                 accepted_per_position=(1,) * d, drafted_per_position=(1,) * d))

    assert pol.decide(1).num_nodes == 4 and pol.depth == 3   # 3 is chosen, 4 (never timed) probed
    key4 = (4, pol.bucket(1))
    step(4, 0.0210)
    assert pol.times[key4] == 0.0210             # an empty entry is filled by the probe's first step
    assert pol.rates[3] is not None
    assert [pol.decide(1).num_nodes for _ in range(pol.PROBE_STEPS - 1)] == [4] * (pol.PROBE_STEPS - 1)
    for _ in range(pol.PROBE_STEPS - 1):
        step(4, 0.0071)
    assert pol.times[key4] == 0.0071             # the run's later steps are samples
    pol.steps_since_spec = pol.probe_every
    assert pol.decide(1).num_nodes == 4          # probed again
    rate_before = pol.rates[3]
    step(4, 0.0210)
    assert pol.times[key4] == 0.0071             # the switch step's time leaves a known entry alone
    assert pol.rates[3] > rate_before            # its acceptance still counts
    for _ in range(pol.PROBE_STEPS - 1):
        assert pol.decide(1).num_nodes == 4
        step(4, 0.0090)
    assert pol.times[key4] == 0.0071             # fresh samples join it (a short window: its fastest)
    # A step of the chosen depth is a sample of its entry: the QUANTILE (a fifth) of a recent
    # window. The start-up profile's figure is no sample: the first step measured in service
    # replaces it (the profile times launches alone, what a host-bound step pays besides is not
    # in it).
    key3 = (3, pol.bucket(1))
    assert pol.times[key3] == steady[3]

    def step3(t, n=1):
        for _ in range(n):
            pol.observe(StepFeedback(batch_size=1, num_tokens=4, draft_len=3, step_time=t,
                                     accepted_per_position=(1, 1, 0), drafted_per_position=(1, 1, 1)))

    step3(0.0080)
    assert pol.times[key3] == 0.0080
    step3(0.0075)
    step3(0.0090, pol.window - 2)
    assert pol.times[key3] == 0.0090   # two fast steps of 48 do not set the figure (the fastest did)
    step3(0.0070, pol.window // 4)
    assert pol.times[key3] == 0.0070   # a quarter of the window does ...
    step3(0.0090, pol.window)
    assert pol.times[key3] == 0.0090   # ... until it has left the window
    assert pol.times[(2, pol.bucket(1))] == steady[2]   # depths not measured in service keep the profile's


def test_auto_renews_a_stale_figure_in_a_probe_run():
    """A depth timed only while the host was slower keeps a high figure no probe used to
    touch: on the H200 (session 13, the demo pair at batch 1) depth 4 stood at 1.33 ms against
    depth 3's 1.09 where both cost about the same, and `auto` ran depth 3 at 0.66x `always`.
    A probe run's later steps replace an entry with no sample for a whole window."""
    pol = AutoPolicy(SpecConfig(draft="x", policy="auto", num_steps=4, topk=1, auto_profile=True))
    pol.warm_up(lambda shapes: {(1, d): t for d, t in {0: 0.0048, 1: 0.0055, 2: 0.0058, 3: 0.006, 4: 0.0062}.items()})
    pol.rates[:] = [0.85, 0.8, 0.75, 0.7]
    pol.evidence = [10 ** 6] * 4   # measured on so many tokens that the probes' moves nothing

    def step(d, t):
        pol.observe(StepFeedback(batch_size=1, num_tokens=d + 1, draft_len=d, step_time=t,
                                 accepted_per_position=(1,) * d, drafted_per_position=(1,) * d))

    key4 = (4, pol.bucket(1))
    for _ in range(5):
        step(4, 0.0075)   # a slow period
    for _ in range(pol.window + 1):
        step(3, 0.0062)
    pol.depth, pol.steps_since_spec = 3, pol.probe_every   # a probe is due
    assert pol.decide(1).num_nodes == 4
    assert pol.depth == 3 and pol.times[key4] == 0.0075
    for t in (0.0300, 0.0063, 0.0064):    # the run: its switch step, then two steady ones
        step(4, t)
        if t != 0.0064:
            assert pol.decide(1).num_nodes == 4
    assert pol.times[key4] == pytest.approx(0.0063)
    assert pol.decide(1).num_nodes == 4 and pol.depth == 4


def _measured_auto(rates: list[float]) -> AutoPolicy:
    """`auto` over len(rates) lengths, profiled at 1 ms each, its rates measured on a million tokens (no
    probe moves them)."""
    pol = AutoPolicy(SpecConfig(draft="x", policy="auto", num_steps=len(rates), topk=1, auto_profile=True))
    pol.warm_up(lambda shapes: {(1, d): 1e-3 for d in range(len(rates) + 1)})
    pol.rates[:] = rates
    pol.evidence = [10 ** 6] * len(rates)
    return pol


def _full_step(pol: AutoPolicy, d: int, t: float) -> None:
    """A batch-1 step of length `d` taking `t` s whose drafts were all accepted."""
    pol.observe(StepFeedback(batch_size=1, num_tokens=d + 1, draft_len=d, step_time=t,
                             accepted_per_position=(1,) * d, drafted_per_position=(1,) * d))


def test_auto_times_a_probe_against_the_steps_just_before_it():
    """Session 13 (H200, demo pair, batch 1): depth 2's figure was the fastest of its window,
    1.09 and 1.38 ms stood for depths 3 and 4 from a slower period, no deeper level could win
    by them, so none was probed again, and `auto` made 0.84x `always`. A deeper level gone
    stale is probed (seldom), and a probe step counts as its time relative to the chosen
    depth's steps just before it, times the chosen depth's figure."""
    pol = _measured_auto([0.85, 0.8, 0.6, 0.5])

    def step(d, t):
        _full_step(pol, d, t)

    k = pol.bucket(1)
    for d, t in ((3, 0.00116), (4, 0.00138)):   # a slow hour of the host
        for _ in range(3):
            step(d, t)
    for _ in range(pol.window + 1):
        step(2, 0.000705)                       # a fast one
    for _ in range(3):
        step(2, 0.0010)                         # now
    pol.depth, pol.steps_since_spec = 2, 0
    assert not pol._could_win(1, 2, 3) and not pol._could_win(1, 2, 4)
    seen = [pol.decide(1).num_nodes for _ in range(4 * pol.probe_every)]
    assert seen[:-1] == [2] * (4 * pol.probe_every - 1) and seen[-1] == 3   # the stale level, seldom
    step(3, 0.0030)                             # the switch step: not timed (a known entry)
    for t in (0.00102, 0.00104):
        assert pol.decide(1).num_nodes == 3
        step(3, t)
    assert pol.times[(3, k)] == pytest.approx(0.00102 * 0.000705 / 0.0010)
    assert pol.decide(1).num_nodes == 3 and pol.depth == 3


def test_auto_keeps_its_depth_through_runs_of_slow_steps():
    """Runs of steps timed far above their steady cost (seen on the H200 at batch 1, where the
    host set the pace) must not price the depth in use out against depths timed earlier."""
    pol = AutoPolicy(SpecConfig(draft="x", policy="auto", num_steps=4, topk=1, auto_profile=True))
    steady = {0: 0.00483, 1: 0.0055, 2: 0.00606, 3: 0.00637, 4: 0.00694}
    pol.warm_up(lambda shapes: {(1, d): t for d, t in steady.items()})
    pol.rates[:] = [0.8, 0.64, 0.512, 0.41]
    rng = random.Random(0)
    chosen = []
    for step in range(400):
        d = pol.decide(1).num_nodes
        chosen.append(d)
        slow = 1.6 if (step // 20) % 2 else 1.0   # 20 normal steps, 20 slow ones, ...
        n = next((i for i in range(d) if rng.random() >= 0.8), d)   # drafts accepted w.p. 0.8 each
        acc = tuple(int(i < n) for i in range(d))
        pol.observe(StepFeedback(batch_size=1, num_tokens=1 + d, draft_len=d, step_time=steady[d] * slow,
                                 accepted_per_position=acc, drafted_per_position=(1,) * d))
    assert sum(1 for d in chosen if d >= 3) >= 0.95 * len(chosen), chosen


def test_auto_prices_the_catch_up_of_resuming():
    """Requests get no draft refresh while auto says 0, so resuming costs a catch-up of every
    missed position: priced at the per-token time measured on prompt / catch-up rows, a long
    off period keeps auto off where a short one would resume, and a catch-up step (which
    drafts nothing) is not taken for the steady cost of depth 0. Once caught up, resuming
    is free again."""
    pol = auto_policy()
    # Depth 4 nearly doubles goodput at batch 16: worth resuming unless catching up is dear.
    feed(pol, 16, lambda d: 0.010 * (1 + 0.1 * d), rate=0.7)
    assert depth_of(pol.decide(16)) == 4
    pol.depth = 0
    assert pol.token_time == pytest.approx(0.010 / 16)   # the prior: a decode row's share
    # A prefill / catch-up step teaches the per-token time (what it added over a decode step).
    pol.observe(StepFeedback(batch_size=16, num_tokens=16 + 200, draft_len=0, step_time=0.010 + 200 * 2e-4,
                             num_prefill_tokens=200))
    assert pol.token_time == pytest.approx(2e-4)
    assert pol.times[(0, pol.bucket(16))] == pytest.approx(0.010)   # not a decode sample
    # 16 requests off for 300 steps: 4800 positions to catch up, ~30 ms a step over the horizon.
    assert pol.decide(16, catchup_tokens=16 * 300) is None and pol.depth == 0
    assert pol.describe()["catchup_tokens"] == 4800
    # Off for 5 steps only: the catch-up is cheap, resume.
    assert depth_of(pol.decide(16, catchup_tokens=16 * 5)) == 4
    # Caught up (nothing owed): the chosen depth stays, whatever the last off period cost.
    assert depth_of(pol.decide(16, catchup_tokens=0)) == 4


def test_auto_learns_acceptance_at_batch_1_on_a_host_bound_table():
    """The bundled demo pair on the H200 (session 6 calls 4 and 6): a step costs 0.69 ms off and
    1.30-2.07 ms with 1-4 drafts (host-bound: the first draft level carries the fixed cost),
    and drafts are accepted often (each level reached with 0.9, then 0.85 given the one before).
    At batch 1 a step gives one token of evidence per position. `auto` must learn that chain 4
    pays (~1.3x off) and stay there: >= 0.93x the best fixed configuration's tokens/s over
    3,000 steps, for every seed (the policy before session 6 made 0.80-0.93x, most steps off)."""
    import math
    import random
    cond = [0.9, 0.85, 0.85, 0.85]
    # call 4's table, then call 6's (faster host): one draft level cannot pay its fixed cost even
    # if always accepted (2 / 0.95 < 1 / 0.45 tokens per ms), four can; only a deeper probe shows it
    for T, seed in [([0.69e-3, 1.30e-3, 1.55e-3, 1.80e-3, 2.07e-3], s) for s in range(4)] + \
            [([0.45e-3, 0.95e-3, 1.00e-3, 1.05e-3, 1.09e-3], s) for s in range(2)]:
        best = max((1 + sum(math.prod(cond[:i + 1]) for i in range(d))) / T[d] for d in range(5))
        rng = random.Random(seed)
        pol = auto_policy(k=4)
        for d in range(5):   # the start-up profile's table
            pol.times[(d, pol.bucket(1))] = T[d]
        tokens = seconds = 0.0
        for _ in range(3000):
            d = depth_of(pol.decide(1))
            acc, ok = [], True
            for i in range(d):
                ok = ok and rng.random() < cond[i]
                acc.append(int(ok))
            tokens, seconds = tokens + 1 + sum(acc), seconds + T[d]
            pol.observe(StepFeedback(batch_size=1, num_tokens=d + 1, draft_len=d, step_time=T[d],
                                     accepted_per_position=tuple(acc), drafted_per_position=(1,) * d))
        assert tokens / seconds >= 0.93 * best, (T[0], seed, tokens / seconds / best)


def test_auto_prices_a_catch_up_by_its_fixed_and_per_row_parts():
    """At batch 1 on a host-bound pair a catch-up step runs without a CUDA graph: 3 rows added
    about what a 130-row prompt did (5 ms). Priced per row alone, the median of such samples
    made a later catch-up of 30 positions cost 20 ms over the horizon and kept auto off; the
    fit prices it at its fixed part plus a little per row, and auto resumes."""
    pol = auto_policy()
    feed(pol, 1, lambda d: 0.4e-3 if d == 0 else 1.0e-3, rate=0.85)
    for rows in (3, 130, 2, 128, 4):   # prompts and catch-ups, each ~5 ms over a decode step
        pol.observe(StepFeedback(batch_size=1, num_tokens=rows + 1, draft_len=0,
                                 step_time=0.4e-3 + 5e-3 + rows * 4e-6, num_prefill_tokens=rows))
    fixed, per_row = pol.catchup_fit()
    assert fixed == pytest.approx(5e-3, rel=0.05) and per_row == pytest.approx(4e-6, rel=0.2)
    assert pol.resume_cost() == 0.0
    pol.depth = 0
    assert depth_of(pol.decide(1, catchup_tokens=30)) == 4
    assert pol.resume_cost() == pytest.approx((5e-3 + 30 * 4e-6) / pol.resume_horizon, rel=0.05)
    # Samples of one size give no line: per row alone, as before.
    one = auto_policy()
    one.observe(StepFeedback(batch_size=1, num_tokens=1, draft_len=0, step_time=1e-3))
    one.observe(StepFeedback(batch_size=1, num_tokens=11, draft_len=0, step_time=3e-3, num_prefill_tokens=10))
    assert one.catchup_fit() == pytest.approx((0.0, 2e-4))


def test_auto_probe_from_off_runs_the_probed_depth_once_caught_up():
    """A probe from off first catches up (steps that draft nothing), then runs the depth it
    probes: on a host-bound table where one draft level cannot pay its fixed cost, that is a
    deeper one (the policy before made every such probe a depth-1 step, which never won)."""
    pol = auto_policy()
    for d, t in enumerate([0.36e-3, 0.85e-3, 0.9e-3, 0.95e-3, 1.0e-3]):
        pol.times[(d, pol.bucket(1))] = t
    pol.rates = [0.2, 0.1, 0.05, 0.02]          # an unlucky start: off is the choice
    pol.evidence = [2, 1, 1, 1]
    seen = []
    for _ in range(40):
        shape = pol.decide(1, catchup_tokens=5)
        seen.append(depth_of(shape))
    probes = [d for d in seen if d]
    assert probes and min(probes) >= 2, seen


def test_auto_keeps_the_draft_fresh_only_near_its_break_even():
    """`keeps_draft_fresh` (decode rows refresh while auto says 0): yes where a depth's
    goodput is within FRESH_WITHIN of off's, no where speculation clearly loses (a dense
    target under load: there off must keep costing nothing)."""
    near = auto_policy()
    feed(near, 1, lambda d: 0.4e-3 if d == 0 else 1.2e-3, rate=0.75)   # off wins, by a little
    assert near.decide(1) is None and near.keeps_draft_fresh(1)
    far = auto_policy()
    feed(far, 64, lambda d: 0.010 * (1 + 1.5 * d), rate=0.8)
    assert far.decide(64) is None and not far.keeps_draft_fresh(64)
    fresh = auto_policy()
    assert not fresh.keeps_draft_fresh(1)   # nothing decided yet


def test_auto_believes_a_deeper_figure_measured_after_a_shallower_one():
    """The cost table's floor (a deeper draft never costs less than a shallower one) binds only
    with figures at least as fresh. Session 12 on the H200: depth 3's 1.79 ms, a probe's figure,
    priced the depth-4 chain that ran at 1.28 ms out, and `auto` sat at 0 (0.67x off)."""
    pol = auto_policy()

    def timed(d, t):   # a step of depth d (drafts all accepted: acceptance is not the point)
        pol.observe(StepFeedback(batch_size=1, num_tokens=d + 1, draft_len=d, step_time=t,
                                 accepted_per_position=(1,) * d, drafted_per_position=(1,) * d))

    timed(0, 0.00068)
    timed(1, 0.00172)
    timed(3, 0.00179)          # stale figures of shallower depths
    for _ in range(5):
        timed(4, 0.00128)      # the depth in use, measured since
    g = pol.goodputs(1)
    assert g[4] == pytest.approx(pol.tau(4) / 0.00128)   # its own figure, not depth 3's
    assert g[3] == pytest.approx(pol.tau(3) / 0.00179)
    assert max(g, key=g.get) == 4
    # A shallower figure measured after the deeper one still bounds it (noise protection).
    timed(3, 0.00150)
    assert pol.goodputs(1)[4] == pytest.approx(pol.tau(4) / 0.00150)


def test_auto_times_a_probe_against_the_median_of_the_steps_before_it():
    """A probe step is one draw of the host's speed; the chosen depth's three steps before it
    are three. Against their fastest, every probe was priced high by the spread of three draws
    (~8% at +-15% noise), enough to keep a deeper level that pays 10% out."""
    pol = _measured_auto([0.85, 0.8, 0.6, 0.5])

    def step(d, t):
        _full_step(pol, d, t)

    k = pol.bucket(1)
    pol.depth = 3
    for _ in range(20):
        for t in (0.0011, 0.0009, 0.0010):
            step(3, t)
    assert pol.times[(3, k)] == 0.0009
    pol.probes.extend([(4, True), (4, False)])
    step(4, 0.0030)                     # the switch step: fills nothing (a known entry)
    step(4, 0.0010)
    assert pol.times[(4, k)] == pytest.approx(0.0010 * 0.0009 / 0.0010)


def test_auto_reevaluates_a_standing_choice_every_few_steps():
    """At batch 1 a decision is host time of every step: the goodputs of a standing choice are
    recomputed every REEVALUATE_EVERY steps while batch size and cost table stand, at once when
    either changes, and at every step for a while after the choice changed."""
    pol = auto_policy(k=2)
    for d in range(3):
        pol.times[(d, pol.bucket(4))] = 0.010 * (1 + 0.2 * d)
    pol.rates[:] = [0.9, 0.8]
    pol.evidence = [10 ** 6] * 2
    calls = []
    real = pol.goodputs
    pol.goodputs = lambda b: calls.append(b) or real(b)
    pol.steps_since_spec = -10 ** 6   # no probes
    assert depth_of(pol.decide(4)) == 2
    calls.clear()
    for _ in range(3 * pol.REEVALUATE_EVERY):
        pol.decide(4)
    settle = pol.REEVALUATE_EVERY - 1   # (the choice changed at the first decision)
    assert len(calls) == settle + -(-(3 * pol.REEVALUATE_EVERY - settle) // pol.REEVALUATE_EVERY)
    calls.clear()
    pol.decide(5)                       # a new batch size: judged at once
    pol.times[(2, pol.bucket(5))] = 0.5   # a changed table: judged at once, and the choice moves
    assert depth_of(pol.decide(5)) < 2 and calls == [5, 5]
    calls.clear()
    for _ in range(pol.REEVALUATE_EVERY):
        pol.decide(5)
    assert len(calls) == pol.REEVALUATE_EVERY   # every step for a while after a change


def test_auto_probes_the_level_its_estimates_rank_best():
    """Where deeper drafts cost the same (a host-bound step at batch 1), a probe from off goes
    straight to the deepest level: one level at a time, `auto` took hundreds of steps to climb
    back after a hard prompt (auto_sim.py with per-request acceptance). Where they cost more
    (under load), the cheapest level that could win is probed."""
    flat = _measured_auto([0.5, 0.3, 0.2, 0.15])
    flat.rates[:] = [0.3, 0.1, 0.05, 0.02]     # a hard prompt: off is chosen
    for d in range(5):
        flat.times[(d, flat.bucket(1))] = 0.6e-3 if d == 0 else 0.9e-3
    flat.steps_since_spec = flat.probe_every
    assert depth_of(flat.decide(1)) == 4 and flat.depth == 0
    steep = _measured_auto([0.5, 0.3, 0.2, 0.15])
    steep.rates[:] = [0.8, 0.6, 0.45, 0.3]
    for d in range(5):
        steep.times[(d, steep.bucket(256))] = 0.014 + 0.012 * d
    steep.steps_since_spec = steep.probe_every
    assert depth_of(steep.decide(256)) == 1 and steep.depth == 0


def test_auto_recovers_quickly_from_a_fall_to_off_on_unlucky_tokens():
    """Batch 1 of a MoE-shaped target: off 1.44 ms, chains of 1-4 3.2-3.9 ms, so off beats a
    chain of 1 and a chain of 4 beats off by 50% at acceptance 0.9. A run of rejected drafts
    sends `auto` off; once the drafts are good again, the levels above off are estimated afresh
    by probes a thin level's interval apart, and the choice is back at 4 within tens of steps
    (with the EMA alone, a 3-step probe every 100 steps moved the low estimate ~20% of the way
    back each time: hundreds of steps off)."""
    pol = auto_policy()
    costs = [1.44e-3, 3.2e-3, 3.4e-3, 3.66e-3, 3.9e-3]
    rng = random.Random(3)

    def step(rate: float) -> int:
        d = depth_of(pol.decide(1))
        k = 0
        while k < d and rng.random() < rate:
            k += 1
        pol.observe(StepFeedback(batch_size=1, num_tokens=d + 1, draft_len=d, step_time=costs[d],
                                 accepted_per_position=(1,) * k + (0,) * (d - k), drafted_per_position=(1,) * d))
        return d

    feed(pol, 1, lambda d: costs[d], rate=0.9, steps=3)
    for _ in range(40):
        step(0.9)
    assert pol.depth == 4
    fell = next((i for i in range(60) if step(0.0) == 0 and pol.depth == 0), None)   # a run of rejections
    assert fell is not None
    back = next((i for i in range(400) if step(0.9) >= 0 and pol.depth == 4), None)
    assert back is not None and back <= 80, back
