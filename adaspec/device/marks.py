"""Timing marks of the steps: points in the device's stream whose spans give a step's time.

On CUDA a mark is a timing event recorded on the stream the steps run on. The events are
made once and used in turn: creating one per mark and looking the current stream up each time
cost 20-50 us of host time per mark on the H200's host (two marks a step;
benchmarks/launch_anatomy.py), which a host-bound step pays in full. On CPU a mark is the wall
clock.
"""
from __future__ import annotations

import time

import torch


class StepMarks:
    """`mark()` -> a timing mark (a recorded CUDA event, or a perf_counter float on CPU).

    Contract: a mark stays valid until `ring` more marks were made. The engine reads a step's
    two marks (`synchronize`, `elapsed_time`) when it collects the step, at most two steps
    after they were made (overlap keeps one step in flight), so a ring of 16 is ample."""

    def __init__(self, device: torch.device, ring: int = 16):
        self.cuda = device.type == "cuda"
        self.i = 0
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(ring)]
            # The stream the steps run on: the device's current stream where the runner is
            # built (the engine steps on it, in whichever thread drives it).
            self.stream = torch.cuda.current_stream(device)

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = self.events[self.i]
        self.i = (self.i + 1) % len(self.events)
        ev.record(self.stream)
        return ev
