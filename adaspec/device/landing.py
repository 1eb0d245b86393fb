"""Pinned host landing buffers for a step's outputs (device -> host copies that do not wait)."""
from __future__ import annotations

import torch


class Landing:
    """Pinned host buffers for one kind of step output, used in turn, so that step N+1's copy
    never overwrites step N's before `collect` read it (a fresh pinned tensor per step would
    be allocated, and sometimes synchronised, by the caching host allocator)."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool):
        """`pin` False (a CPU engine): no buffers, `take` clones instead."""
        self.bufs = [torch.empty(numel, dtype=dtype, pin_memory=True) for _ in range(2)] if pin else None
        self.flip = 0

    def take(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """`t` copied to the host without waiting (None stays None). On the CPU a clone: a
        graph's static output is overwritten by the next step."""
        if t is None:
            return None
        if self.bufs is None:
            return t.clone()
        host = self.bufs[self.flip][: t.numel()].view(t.shape)
        self.flip ^= 1
        host.copy_(t, non_blocking=True)
        return host
