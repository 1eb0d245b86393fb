"""What a step costs the engine's cadence: the figure the speculation policy prices depths by.

A step's CUDA-event span (`ModelRunner.last_step_time`) is its device time, and under overlap
that is the step's cost only while the device sets the pace. When the host sets it (a small
model, a speculative step at batch 1) the engine's cadence is the host's work per step:
scheduling, staging and launching, reading back, postprocessing, and what the caller does
between two `Engine.step` calls (the server sends each step's outputs on). The span sees only
the launch part of that: on the H200 the bundled demo pair's plain step spans 0.48 ms and a
chain-4 step 1.70, where serving paid about 0.9 and 1.8 per step, so a policy fed spans priced
speculation about 1.7x dearer than it was (session 7: `auto` 0.92x of off, mostly off, where
always speculating made 1.11x; session 8: 1.25x).

    cost(N) = max(device span of N, host busy time of the cycle that launched N)

The host busy time of a cycle is the wall time of the `step()` call that launched N, minus the
time that call spent blocked on the device (with overlap that wait is for step N-1, and is
device time, not host work), plus the time since the previous call returned, if the engine
still had work then (the caller's share of the cycle; an idle engine's wait is not counted).
Without overlap the step is collected inside the call that launched it, and the whole call
(its waits included: nothing overlaps them) is the cost.
"""
from __future__ import annotations

import time


class StepClock:
    """Driven by `Engine.step`: `call_began`, `launched` (a step went in flight in this call),
    `collected` (a step was read back; returns its cost in seconds), `call_ended`."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._t0 = 0.0
        self._gap = 0.0
        self._returned: float | None = None   # when the last call returned with work left
        self._waited = 0.0                    # seconds this call was blocked on the device
        self._in_flight_host: float | None = None   # host seconds of the cycle that launched the step in flight
        self._launched_here = False

    def call_began(self) -> None:
        now = self.clock()
        self._gap = now - self._returned if self._returned is not None else 0.0
        self._t0, self._waited, self._launched_here = now, 0.0, False

    def launched(self) -> None:
        self._launched_here = True
        self._in_flight_host = None   # known when this call ends

    def collected(self, waited: float, device: float) -> float:
        """The collected step's cost: max(its device span, its cycle's host time)."""
        self._waited += waited
        if self._launched_here:   # launched and collected in this call (no overlap)
            host = self._gap + self.clock() - self._t0
            self._launched_here = False
        else:
            host = self._in_flight_host if self._in_flight_host is not None else 0.0
        self._in_flight_host = None
        return max(device, host)

    def call_ended(self, busy: bool) -> None:
        now = self.clock()
        if self._launched_here:
            self._in_flight_host = self._gap + now - self._t0 - self._waited
        self._returned = now if busy else None
