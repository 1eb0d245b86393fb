"""The `auto` speculation policy: the draft depth (0 included) that maximizes measured goodput
(the class docstring states the model); the registry is spec_decode/policy.py."""
from __future__ import annotations

import logging
import time
from collections import deque

from adaspec.config import SpecConfig
from adaspec.spec_decode.cost_table import CostTable, CostWindow, fixed_and_per_row
from adaspec.spec_decode.policy_base import SpeculationPolicy, StepFeedback
from adaspec.spec_decode.tree import DraftShape

logger = logging.getLogger("adaspec.spec_decode")


class AutoPolicy(SpeculationPolicy):
    """Pick the draft depth (0 included) that maximizes expected emitted tokens per second.

    goodput(b, d) = b * tau(d) / T(b, d), where
      tau(d)  = 1 + sum_{i<d} r_i, r_i the measured rate at which depth i+1 is reached
                (per drafted token: a running mean over its first tokens, then an EMA of ~14
                tokens' memory, so that batch 1's one token per step does not swing it; depths
                never measured are extrapolated geometrically from the deepest one that was);
      T(b, d) = measured step time at batch b with depth-d drafts: the `QUANTILE` of the
                last `window` steps per batch-size bucket (seeded by a start-up profile,
                interpolated between buckets). Not a mean: on the H200, runs of steps at
                one depth were timed 40-70% slow (the host, not the device, setting the
                pace), and a mean then priced the depth in use out against depths timed
                earlier, so the choice flapped. Nor the fastest: the least of 48 noisy steps is
                noisy itself, and priced the demo pair's equal depths 5-16% apart at batch 1
                (auto_sim.py with session 17's served noise: 0.985 of the best fixed length,
                0.993 with the 20th percentile). Costs that grow (longer contexts) still show.
    Resuming: while off, requests get no draft refresh, so speculating again first costs a
    catch-up, a target forward over every missed position (`catchup_tokens` of them, priced
    by `catchup_fit`: a fixed part and `token_time` per row, fitted to steps that ran prompt or
    catch-up rows, seeded by the start-up profile). Prompts refresh the draft whatever the
    policy says (engine/scheduler.py), so what is owed is the decode steps run off. That
    cost is spread over `resume_horizon` steps and added to the
    step time of every depth > 0 while it is owed: the longer the policy was off (and the
    longer the contexts), the more a depth must win by to resume, so it does not flap
    between 0 and K when catching up is expensive.
    Stability: the current choice is kept unless another beats it by `margin`. Once every
    `probe_every` steps it runs, among the deeper levels that could win at this batch size if
    their extra tokens were always accepted, the one the current estimates rank best (under
    load usually one level deeper, where a probe is cheapest; on a host-bound step, where every
    depth costs about the same, the deepest), so acceptance there is measured rather than
    only extrapolated.
    Where a deeper level has been measured on fewer than THIN_EVIDENCE tokens, the probe goes
    that deep and comes ten times as often: at batch 1 a choice that fell back to off on two
    unlucky tokens otherwise stayed off (a host-bound pair whose chain 4 pays 1.3x ran at
    0.80-0.93x of it, most steps off; tests/spec_decode/test_policy.py). A fall to off at
    such a batch makes every level thin again (`_recheck_after_fall`).
    """

    name = "auto"
    LOG_EVERY_S = 1.0
    PRIOR_TOKENS = 4          # the prior rate's weight, in drafted tokens, against the first evidence
    THIN_EVIDENCE = 8         # a depth measured on fewer drafted tokens is probed 10x as often
    RECHECK_PRIOR_TOKENS = 1  # after a fall to off at a small batch: the old rates' weight (_recheck_after_fall)
    FRESH_WITHIN = 0.8        # keeps_draft_fresh: a depth within this of off's goodput
    PROBE_STEPS = 3           # a probe runs this many steps; the first (the switch) is not timed
    REEVALUATE_EVERY = 8      # steps a choice's goodputs serve while their inputs but the rates stand
    prices_catchup = True
    BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    QUANTILE = 0.2            # of a cost window's steps: the figure a depth is priced by (T above)
    TABLE_TOLERANCE = 0.005   # ... followed within this fraction (each change of the table is a decision redone)

    def __init__(self, cfg: SpecConfig, margin: float = 0.05, ema: float = 0.07, probe_every: int = 100,
                 prior_rate: float = 0.6, window: int = 48, resume_horizon: int = 32):
        super().__init__(cfg)
        self.max_depth = self.configured.num_steps
        self.shapes: list[DraftShape | None] = [None] + [self.configured.capped(d) for d in range(1, self.max_depth + 1)]
        self.margin, self.ema, self.probe_every = margin, ema, probe_every
        self.rates: list[float | None] = [None] * self.max_depth  # r_i, None = never measured
        self.evidence = [0] * self.max_depth                       # drafted tokens behind each r_i
        self.prior_rate = prior_rate
        self.times = CostTable()                                  # (depth, bucket) -> seconds
        self.samples: dict[tuple[int, int], CostWindow] = {}      # the recent step times behind each
        self.profiled: set[tuple[int, int]] = set()   # entries still the start-up profile's (see warm_up)
        self.sampled_at: dict[tuple[int, int], int] = {}   # entry -> the observed step that last sampled it
        self.num_observed = 0
        self.window = window
        self.depth = 0
        self.steps_since_spec = 0
        self.last_goodputs: dict[int, float] = {}
        self._eval_key, self._eval_age = None, 0   # what the last goodputs were computed for (_current_goodputs)
        self._eval_depth, self._settling = 0, 0
        self.probes: deque = deque()   # (depth, first of its run) of probe steps decided, not yet observed
        self.probe_run: list | None = None   # [depth, steps left] of the probe running
        self.recent: deque = deque(maxlen=3)   # (entry, seconds) of the last steady steps
        self._rates_cache: tuple = ((), [])   # (rates, rate_estimates()) of the last call
        self._times_cache: dict = {}   # batch size -> step_time per depth, for one cost-table version
        self._last_log, self._unlogged = -float("inf"), 0   # see _log_change
        self.resume_horizon = resume_horizon
        self.token_samples: deque = deque(maxlen=window)   # (prompt / catch-up rows, seconds they added)
        self._catchup_fit: tuple[float, float] | None = None   # (fixed s, s per row) of those samples
        self.profiled_token_time: float | None = None
        self.catchup_tokens = 0
        self.resuming = 0   # steps left of a probe from off still catching up (see decide)
        self.resume_depth = 1   # the depth that probe runs once caught up
        self._buckets: dict[int, int] = {}   # batch size -> bucket index (`bucket`)

    # ---- estimates ------------------------------------------------------------------------
    def bucket(self, b: int) -> int:
        i = self._buckets.get(b)
        if i is None:
            i = self._buckets[b] = min(range(len(self.BUCKETS)), key=lambda i: abs(self.BUCKETS[i] - b))
        return i

    def step_time(self, b: int, depth: int) -> float | None:
        """Estimated seconds of a step of b requests at depth d (None: no data at all)."""
        pts = self.times.points(depth, self.BUCKETS)
        if not pts:
            return None
        if len(pts) == 1:
            return pts[0][1] * max(1.0, b / pts[0][0]) if b > pts[0][0] else pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if b <= b1:
                if b <= b0:
                    return t0
                return t0 + (t1 - t0) * (b - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (b - b1)

    def rate_estimates(self) -> list[float]:
        key = (self.prior_rate, *self.rates)
        if self._rates_cache[0] != key:   # (the rates change with most observations, not twice per step)
            self._rates_cache = (key, self._rate_estimates())
        return self._rates_cache[1]

    def _rate_estimates(self) -> list[float]:
        out, last, cond = [], 1.0, self.prior_rate
        for r in self.rates:
            if r is None:
                last = last * cond
            else:
                cond = r / last if last > 0 else 0.0
                cond = min(max(cond, 0.0), 1.0)
                last = r
            out.append(last)
        return out

    def tau(self, depth: int, rates: list[float] | None = None) -> float:
        """Expected tokens a step at `depth` emits per request (`rates`: rate_estimates(), when
        the caller has them already)."""
        return 1.0 + sum((rates if rates is not None else self.rate_estimates())[:depth])

    def catchup_fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per row) that prompt / catch-up rows add to a step:
        `fixed_and_per_row` of recent measurements (at batch 1 3 catch-up rows added about
        what a 130-row prompt did, 5 ms, an eager step's fixed cost); with no measurement yet,
        no fixed part and the profile's per row, else a decode row's share of the largest
        timed decode batch."""
        if not self.token_samples:
            if self.profiled_token_time is not None:
                return 0.0, self.profiled_token_time
            pts = [(self.BUCKETS[k], t) for (d, k), t in self.times.items() if d == 0]
            b, t = max(pts) if pts else (1, 0.0)
            return 0.0, t / b
        if self._catchup_fit is None:
            self._catchup_fit = fixed_and_per_row(self.token_samples)
        return self._catchup_fit

    @property
    def token_time(self) -> float:
        """Seconds a catch-up row adds to a step beyond the fixed part (`catchup_fit`)."""
        return self.catchup_fit()[1]

    def resume_cost(self) -> float:
        """Seconds per step that speculating now owes for the catch-up (spread over
        `resume_horizon` steps)."""
        if not self.catchup_tokens:
            return 0.0
        fixed, per_row = self.catchup_fit()
        return (fixed + self.catchup_tokens * per_row) / self.resume_horizon

    def step_times(self, b: int) -> list[float | None]:
        """step_time(b, d) for every depth, computed once per version of the cost table (a
        decision is host time of every step)."""
        if self._times_cache.get("version") != self.times.version:
            self._times_cache = {"version": self.times.version}
        out = self._times_cache.get(b)
        if out is None:
            out = self._times_cache[b] = [self.step_time(b, d) for d in range(self.max_depth + 1)]
        return out

    def goodputs(self, b: int) -> dict[int, float]:
        out, shallower = {}, []
        owed = self.resume_cost()
        rates = self.rate_estimates()
        times = self.step_times(b)
        k = self.bucket(b)
        tau = 1.0
        for d in range(self.max_depth + 1):
            if d:
                tau += rates[d - 1]
            t = times[d]
            if t is not None and d > 0:
                t += owed
            if t is not None and t > 0:
                # Deeper drafts do strictly more work: never believe a noisy table that says
                # they are cheaper than a shallower one, unless the deeper figure was measured
                # after it. A shallower depth runs only in probes, and its figure can be long
                # stale: on the H200 (session 12) depth 3's 1.79 ms from a probe priced the
                # depth-4 chain running at 1.28 ms out, and `auto` sat at 0 (0.67x off).
                at = self.sampled_at.get((d, k), -1)
                cost = max([t] + [te for te, ae in shallower if ae >= at])
                shallower.append((t, at))
                out[d] = b * tau / cost
        return out

    def _current_goodputs(self, b: int, catchup_tokens: int) -> dict[int, float]:
        """goodputs(b), recomputed at every step for REEVALUATE_EVERY steps after a change of
        choice, and when the batch size, the owed catch-up or the cost table changed; else
        every REEVALUATE_EVERY steps: the rates move by an EMA of ~14 tokens, and at batch 1 a
        decision is host time of every step (on the H200 host `decide` cost 30-50 us of a 1 ms
        step with 8 depths)."""
        if self.depth != self._eval_depth:   # a new choice: judged afresh at every step for a while
            self._eval_depth, self._settling = self.depth, self.REEVALUATE_EVERY
        key = (b, catchup_tokens, self.times.version)
        if key != self._eval_key or self._eval_age >= self.REEVALUATE_EVERY or self._settling:
            self._eval_key, self._eval_age = key, 0
            self.last_goodputs = self.goodputs(b)
        self._eval_age += 1
        self._settling = max(0, self._settling - 1)
        return self.last_goodputs

    def keeps_draft_fresh(self, batch_size: int) -> bool:
        """Near the break-even (a depth's goodput within FRESH_WITHIN of off's at the last
        decision) the choice flips, and at batch 1 each flip back cost a catch-up step with an
        eager post-forward (5 ms on the H200 for the demo pair before its target forward got a
        padded graph, 1 ms a step), where the refresh rides in the post graph. Far from it
        (dense targets under load), off still costs nothing."""
        g = self.last_goodputs
        return 0 in g and max((v for d, v in g.items() if d), default=0.0) >= self.FRESH_WITHIN * g[0]

    # ---- decision -------------------------------------------------------------------------
    def decide(self, batch_size: int, catchup_tokens: int = 0) -> DraftShape | None:
        self.catchup_tokens = catchup_tokens
        if self.resuming:
            # A probe from off first catches the drafts up (a step that drafts nothing): it
            # lasts until a step drafts, else its acceptance would never be measured.
            self.resuming = self.resuming - 1 if catchup_tokens else 0
            self.probes.append((self.resume_depth, False))
            return self.shapes[self.resume_depth]
        if self.probe_run is not None:   # the rest of a probe's run
            depth, left = self.probe_run
            self.probe_run = [depth, left - 1] if left > 1 else None
            self.probes.append((depth, False))
            return self.shapes[depth]
        g = self._current_goodputs(max(1, batch_size), catchup_tokens)
        if not g:
            return self.shapes[self.depth]
        best = max(g, key=g.get)
        if self.depth not in g or g[best] > g[self.depth] * (1 + self.margin):
            if best != self.depth:
                self._log_change(self.depth, best, batch_size, g)
                if best == 0 and batch_size < self.THIN_EVIDENCE:
                    self._recheck_after_fall()
            self.depth = best
        # Probing: acceptance is only measured at depths that run, and an extrapolation from
        # shallower ones can keep a policy below a deeper draft that would pay. Once every
        # `probe_every` steps, run a deeper level where perfect acceptance could win (on a
        # host-bound step the first draft level carries the fixed cost and cannot win alone
        # while deeper ones can): the one today's estimates rank best. A level measured on few
        # tokens (batch 1, or a choice that fell back before it was known) is probed ten times
        # as often: an estimate from two tokens must not keep a policy off for good.
        self.steps_since_spec += 1
        if self.steps_since_spec < max(1, self.probe_every // 10):   # no probe can be due yet
            return self.shapes[self.depth]
        if self.steps_since_spec < self.probe_every and \
                min(self.evidence[self.depth:], default=self.THIN_EVIDENCE) >= self.THIN_EVIDENCE:
            return self.shapes[self.depth]   # ... nor before probe_every, but a thin level's
        deeper = [d for d in range(self.depth + 1, self.max_depth + 1) if self._could_win(batch_size, self.depth, d)]
        # (by today's goodput, untimed first: probing one level at a time from off took hundreds
        # of steps to climb back after a hard prompt, benchmarks/auto_sim.py --regime-every)
        deeper.sort(key=lambda d: -g.get(d, float("inf")))
        thin = [d for d in deeper if self.evidence[d - 1] < self.THIN_EVIDENCE]
        # A deeper level whose figure went stale may be priced out by a slower hour of the
        # host: it is probed too, four times as seldom (well under 1% of steps under load).
        stale = [d for d in range(self.depth + 1, self.max_depth + 1) if self._stale((d, self.bucket(batch_size)))]
        probe = (thin or deeper or stale or [None])[0]
        every = max(1, self.probe_every // 10) if thin else self.probe_every * (1 if deeper else 4)
        if probe is not None and self.steps_since_spec >= every:
            self.steps_since_spec = 0
            self.probes.append((probe, True))
            if self.depth == 0 and catchup_tokens:
                self.resuming, self.resume_depth = 4, probe   # chunked catch-ups included
            elif self.PROBE_STEPS > 1:
                self.probe_run = [probe, self.PROBE_STEPS - 1]
            return self.shapes[probe]
        return self.shapes[self.depth]

    def _recheck_after_fall(self) -> None:
        """The choice fell back to off at a batch whose steps measure a few tokens each: every
        level is estimated afresh. Off measures nothing, so with the EMA alone each 3-step probe
        moved a low estimate ~20% of the way back at batch 1, and a fall on a few unlucky
        tokens lasted hundreds of steps (benchmarks/auto_sim.py, a MoE-shaped batch 1 where off
        beats a chain of 1 and a chain of 4 beats off by 24%: 14-75% of some seeds' steps off;
        results/cpu/auto_sim_session15_2026-12-04/). Now the rates that made the fall count as
        one token (RECHECK_PRIOR_TOKENS: they are the unlucky ones), the next probes come as
        often as for a thin level, and a running mean of what they measure replaces them."""
        self.evidence = [self.RECHECK_PRIOR_TOKENS - self.PRIOR_TOKENS] * self.max_depth
        self.steps_since_spec = 0   # the first re-probe a thin level's interval later, not at once

    def _log_change(self, old: int, new: int, b: int, g: dict[int, float]) -> None:
        """One INFO line per change of choice, with the numbers that made it. Changes less than
        `LOG_EVERY_S` after the last line are counted into the next one instead (a batch size
        hovering at a boundary must not flood the log; the stats line shows the state)."""
        now = time.monotonic()
        if now - self._last_log < self.LOG_EVERY_S:
            self._unlogged += 1
            return
        step_ms = {d: round(1e3 * t, 3) for d in range(self.max_depth + 1)
                   if (t := self.step_time(max(1, b), d)) is not None}
        more = f" ({self._unlogged} more changes since the last line)" if self._unlogged else ""
        if self.catchup_tokens:
            more += f", a catch-up of {self.catchup_tokens} positions owed"
        logger.info("auto: draft length %d -> %d at batch size %d: expected tokens/s by draft length %s, "
                    "acceptance length %s, step ms %s%s", old, new, b,
                    {d: round(v, 1) for d, v in g.items()},
                    {d: round(self.tau(d), 2) for d in range(self.max_depth + 1)}, step_ms, more)
        self._last_log, self._unlogged = now, 0

    def _could_win(self, b: int, depth: int, deeper: int) -> bool:
        """Could `deeper` beat `depth` if its extra draft tokens were always accepted? A depth
        never timed at any batch size could: only running it measures its cost (without a
        start-up profile this is how the cost table learns any depth beyond the current one)."""
        t0, t1 = self.step_time(b, depth), self.step_time(b, deeper)
        if t1 is None:
            return True
        if t0 is None:
            return False
        t1 += self.resume_cost()   # (owed by every depth > 0; 0 once speculating)
        if depth:
            t0 += self.resume_cost()
        rates = self.rate_estimates()
        reach = rates[depth - 1] if depth else 1.0   # chance of reaching it
        tau = self.tau(depth, rates)
        return (tau + reach * (deeper - depth)) / t1 > tau / t0

    def observe(self, fb: StepFeedback) -> None:
        self.num_observed += 1
        depth = len(fb.drafted_per_position)
        probe = first = False
        if self.probes and self.probes[0][0] == depth:
            probe, first = True, self.probes.popleft()[1]
        self.last_was_probe = probe
        key = (depth, self.bucket(fb.batch_size))
        # A probe is a short run of another depth between steps of the chosen one; its
        # acceptance counts. The step that switches to it is not that depth's steady cost
        # (measured on the H200: a depth-3 probe between depth-2 steps took 22 ms where depth-3
        # steps take 7): it only fills an empty entry. The run's later steps are samples like
        # any, and replace an entry gone stale (no sample for `window` steps): a depth timed
        # once, when the host was slower, kept its figure for good otherwise (session 13:
        # depth 4 at 1.33 ms against depth 3's 1.09, both costing about the same; `auto` stayed
        # at 3, 0.66x `always`).
        if fb.num_prefill_tokens == 0 and fb.batch_size > 0 and not (probe and first and key in self.times):
            t = fb.step_time
            if probe:
                if self._stale(key):
                    self.samples.pop(key, None)   # the run's steps replace its samples
                # Timed against the chosen depth's steps just before it, times the chosen
                # depth's figure. Against their median, not their fastest: a probe step is one
                # draw of the host's speed of the moment, and the fastest of three priced every
                # probe ~8% dear under a step noise of +-15% (the demo pair's on the H200).
                ref = (self.depth, key[1])
                near = sorted(x for e, x in self.recent if e == ref)
                if near and ref in self.times and key != ref:
                    t *= self.times[ref] / near[len(near) // 2]
            else:
                self.recent.append((key, t))
            self._sample(key, t)
        elif fb.num_prefill_tokens > 0:   # what its prompt / catch-up rows added to the step
            decode = self.step_time(max(1, fb.batch_size), depth)
            if decode is not None:
                self.token_samples.append((fb.num_prefill_tokens, max(0.0, fb.step_time - decode)))
                self._catchup_fit = None
        # (the estimates only while a depth has no evidence yet: they change with every
        # observation, and at batch 1 a policy's work is host time of every step)
        prior = self.rate_estimates() if None in self.rates else None
        for i, (a, n) in enumerate(zip(fb.accepted_per_position, fb.drafted_per_position)):
            if n:
                r = a / n
                # A depth's first evidence updates the prior (extrapolated) estimate instead of
                # replacing it: one rejected probe must not read as "this depth never accepts".
                old = self.rates[i] if self.rates[i] is not None else prior[i]
                # n drafted tokens' worth of evidence: a running mean over the first tokens (the
                # prior counting PRIOR_TOKENS), then an EMA of `ema` per token: ~14 tokens of
                # memory, so that one-token steps (batch 1) do not swing the choice while a
                # collapse still shows within a few dozen steps.
                w = max(1 - (1 - self.ema) ** n, n / (self.PRIOR_TOKENS + self.evidence[i] + n))
                self.evidence[i] += n
                self.rates[i] = (1 - w) * old + w * r

    def _stale(self, key: tuple[int, int]) -> bool:
        """No sample of this entry for a whole window of observed steps."""
        return key in self.times and self.num_observed - self.sampled_at.get(key, self.num_observed) > self.window

    def _sample(self, key: tuple[int, int], t: float) -> None:
        if key in self.profiled:   # the first step measured in service replaces the profile's figure
            self.profiled.discard(key)
            self.samples.pop(key, None)
        w = self.samples.get(key) or self.samples.setdefault(key, CostWindow(self.window))
        w.add(t)
        self.sampled_at[key] = self.num_observed
        q, old = w.quantile(self.QUANTILE), self.times.get(key)
        if old is None or abs(q - old) > self.TABLE_TOLERANCE * old:
            self.times[key] = q

    def describe(self) -> dict:
        cost: dict[str, dict[int, float]] = {}
        for (d, k), t in sorted(self.times.items()):
            cost.setdefault(str(d), {})[self.BUCKETS[k]] = round(t * 1e3, 3)
        return {**super().describe(), "depth": self.depth, "catchup_tokens": self.catchup_tokens,
                "catchup_token_us": round(self.token_time * 1e6, 3),
                "catchup_fixed_us": round(self.catchup_fit()[0] * 1e6, 3),
                "tau": [round(self.tau(d), 3) for d in range(self.max_depth + 1)],
                "goodput": {d: round(v, 2) for d, v in self.last_goodputs.items()},
                "step_ms": cost}   # the cost table: depth -> {batch bucket: ms}

    # ---- start-up profile -----------------------------------------------------------------
    def warm_up(self, profile) -> None:
        """`profile(shapes)` -> {(batch size, depth index): seconds}: measured step times that
        seed the cost table before the first request; an entry "catchup_token" (seconds a
        prompt or catch-up row adds to a step) seeds `token_time`. A profiled entry stands
        until its depth and bucket are measured in service, then gives way (not a sample among
        them): the profile times launches alone, without the scheduling, postprocessing and
        output work a served step also pays (all of a host-bound step's difference), so its
        figures run low, and the minimum of a window would keep them."""
        if self.cfg.auto_profile:
            for key, t in profile(self.shapes).items():
                if key == "catchup_token":
                    self.profiled_token_time = t
                else:
                    b, d = key
                    k = (d, self.bucket(b))
                    self._sample(k, t)
                    self.profiled.add(k)
