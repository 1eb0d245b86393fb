"""Pinned host landing buffers for a step's outputs (device -> host copies that do not wait)."""
from __future__ import annotations

import torch


class Landing:
    """Pinned host buffers for one kind of step output, used in turn, so that step N+1's copy
    never overwrites step N's before `collect` read it (a fresh pinned tensor per step would
    be allocated, and sometimes synchronised, by the caching host allocator)."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool):
        self.bufs = [torch.empty(numel, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self.flip = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        host = self.bufs[self.flip][: t.numel()].view(t.shape)
        self.flip ^= 1
        host.copy_(t, non_blocking=True)
        return host
