"""How many prefill tokens a step may carry next to decode rows.

A long prompt prefilled in big chunks stalls every running stream: each of its chunks lands
in a step that the streams wait for. The pacer bounds the chunk so that a step with prefill
costs at most `itl_ratio` (1.8, a margin under the 2x target) times a decode-only step,
from measured quantities:

    t_decode       an EMA of the time of steps without prefill rows
    fixed, t_token what prefill rows add to a step, fitted to the last `window` steps with
                   prefill as fixed + t_token * tokens (spec_decode/cost_table.fixed_and_per_row)

    allowed = (itl_ratio - 1) * t_decode
    cap = max((allowed - fixed) / t_token,   the chunk the latency bound allows
              fixed / t_token,               the chunk that earns its fixed cost (see below)
              min_chunk)

and never below `per_decode` (16) x the step's decode tokens: at high concurrency prefill must
keep pace with the requests the batch finishes, and they finish in bursts (answers that started
together end together), so the floor is sized for refilling a burst, not for the average (a
512-token prompt per 256-token answer needs two prefill tokens per decode token). Measured on
the H200 (8B shape, offline closed loop of 64 clients, 512 in / 256 out,
benchmarks/closed_loop.py, session 5 call 3): with a floor of 4, prefill ran in 55% of the steps,
a ninth of the batch waited for it, and the engine made 4,710 tok/s (TPOT 11.0 ms, p99 TTFT 4.6 s)
against 6,527 unpaced (TPOT 8.4 ms, worst step 185 ms); a 1,024-token cap (16 per decode token
there) made 6,537 tok/s, TPOT 9.1 ms, worst step 29 ms, p99 TTFT 0.8 s.

Why the fixed part: a step pays for carrying any prefill beyond its token count (where it
runs eagerly its launches are host time, and on a mixture of experts a few prompt rows read
most of the experts; engine/cuda_graph.py's token graphs take the launches away). Priced per
token alone, small chunks look dear, so the cap shrinks, and each small chunk pays the fixed
cost again: on the Qwen3-30B-A3B shape (H200, session 18, 512 in / 256 out) a step with prompt
rows cost about 58 ms more than a decode step whatever their number, and chain 3 at concurrency 2
waited 457 ms for a first token (p50): 8 chunks of 64 tokens, each paying it (the results in
benchmarks/results/h200/session18_2026-12-05/, a simulation in benchmarks/pacer_sim.py).
So a chunk is never smaller than `fixed / t_token` tokens, which cost what the fixed part does:
below it a step spends more on the fixed part than on prompt tokens, and streams stall more often
for less prefill. Where the fixed part alone exceeds the latency bound (no chunk keeps it: a
mixture of experts at small batch), that chunk is the cap; where it is under the bound but large,
it can take a step past the bound (at most to twice the fixed part). That chunk is extrapolated
at most 2x past the largest chunk measured (a line through small chunks must not send a whole
budget at once): it grows as it is confirmed.
Until there are measurements the cap is `default_cap`. A fixed `long_prefill_token_threshold`
replaces the measured cap. Linear in tokens past the fixed part on purpose: on a GPU small
chunks cost less than linear, so the cap errs towards smaller chunks, which only costs prefill
speed while streams run.
"""
from __future__ import annotations

from collections import deque

from adaspec.spec_decode.cost_table import fixed_and_per_row


class PrefillPacer:
    def __init__(self, fixed_cap: int = 0, itl_ratio: float = 1.8, per_decode: int = 16, min_chunk: int = 4,
                 default_cap: int = 32, ema: float = 0.2, window: int = 32):
        self.fixed_cap, self.itl_ratio, self.per_decode = fixed_cap, itl_ratio, per_decode
        self.min_chunk, self.default_cap, self.ema = min_chunk, default_cap, ema
        self.t_decode: float | None = None
        self.samples: deque = deque(maxlen=window)   # (prefill tokens, seconds they added)
        self._fit: tuple[float, float] | None = None

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) that prefill adds to a step; (0, 0) unmeasured."""
        if self._fit is None:
            self._fit = fixed_and_per_row(self.samples)
        return self._fit

    def cap(self, decode_tokens: int) -> int | None:
        """Prefill tokens allowed in a step with `decode_tokens` decode rows (None: no cap)."""
        if not decode_tokens:
            return None
        if self.fixed_cap:
            base = self.fixed_cap
        elif self.t_decode is None or not self.samples:
            base = self.default_cap
        else:
            fixed, per = self.fit()
            tried = 2 * max(n for n, _ in self.samples)   # no further than 2x the largest chunk measured
            if per <= 0.0:     # measured as free past the fixed part
                base = tried
            else:
                allowed = (self.itl_ratio - 1.0) * self.t_decode
                base = max(self.min_chunk, round(max((allowed - fixed) / per, min(fixed / per, tried))))
        return max(base, self.per_decode * decode_tokens)

    def observe(self, step_time: float, prefill_tokens: int) -> None:
        """Feed a collected step's wall time and its prefill tokens."""
        if step_time <= 0:
            return
        if prefill_tokens == 0:
            self.t_decode = step_time if self.t_decode is None else \
                self.t_decode + self.ema * (step_time - self.t_decode)
        elif self.t_decode is not None and prefill_tokens >= self.min_chunk:
            self.samples.append((prefill_tokens, max(step_time - self.t_decode, 0.0)))
            self._fit = None
