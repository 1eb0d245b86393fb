"""Overlap corrections: staged metadata shifted on the device by what the step in flight emitted.

With overlap, step N+1 is staged before step N's output is read back, as if N emitted one
token per request. `Shift` records which staged entries depend on that count; `apply` adds
`last_count[row] - 1` to each on the device and recomputes the registered slots, in one Triton
launch on CUDA (`shift_kernels`) or a few PyTorch ops elsewhere.
"""
from __future__ import annotations

import numpy as np
import torch

from adaspec.device import shift_kernels
from adaspec.device.staging import _ELEMENT_SIZE, Staging, _Ref


class Shift:
    """Staged metadata that depends on how many tokens the previous step emitted, for requests
    whose previous step is still in flight (overlap). The host stages as if that step emitted
    one token; `apply` then adds `last_count[row] - 1` on the device to each registered
    position-like entry and recomputes the registered slots from the shifted cache indices.

    Entries are addressed inside one staging buffer (every field lives in `stg.dev`), so the
    correction is a handful of device ops whatever the number of fields and draft steps."""

    def __init__(self, stg: Staging):
        self.stg = stg
        # Registered parts, staged as one [k, n] array each by `stage` (no array per part):
        self.i64: list[tuple] = []    # (element indices in the int64 view, device rows)
        self.i32: list[tuple] = []    # the same, int32 view
        self.slots: list[tuple] = []  # (slot elements, staged cache indices, device rows)

    @staticmethod
    def _elements(ref: "_Ref", idx) -> np.ndarray:
        size = _ELEMENT_SIZE[ref.dtype]
        return ref.start // size + np.asarray(idx, dtype=np.int64)

    def add(self, ref: "_Ref", idx, rows) -> None:
        """Shift elements `idx` (flat, of `ref`) by the delta of device rows `rows`."""
        if len(idx):
            (self.i64 if ref.dtype == torch.int64 else self.i32).append((self._elements(ref, idx), rows))

    def add_slots(self, slot_ref: "_Ref", idx, cache_index, rows) -> None:
        """Recompute slots `idx` of `slot_ref` as the slot of `cache_index` + the delta of device
        row `rows` (`cache_index`: the host's values, those the staged slots were computed
        from; one per slot), where the staged slot is not -1 (a row that writes no KV). A
        slot never reads a shifted entry, so entries and slots move in one launch."""
        if len(idx):
            self.slots.append((self._elements(slot_ref, idx), np.asarray(cache_index, dtype=np.int64), rows))

    def __bool__(self) -> bool:
        return bool(self.i64 or self.i32 or self.slots)

    def stage(self, into: Staging) -> dict:
        """Stage the index arrays (into the step's buffer); returns handles for `apply`."""
        return {"i64": self._stage(into, self.i64, 2), "i32": self._stage(into, self.i32, 2),
                "slots": self._stage(into, self.slots, 3)}

    @staticmethod
    def _stage(into: Staging, parts: list[tuple], k: int):
        """The parts side by side, one [k, n] int64 field (an int broadcasts over its part)."""
        h, ref = into.reserve((k, sum(len(p[0]) for p in parts)), torch.int64)
        at = 0
        for p in parts:
            m = len(p[0])
            for r in range(k):
                h[r, at: at + m] = p[r]
            at += m
        return ref

    def apply(self, staged: dict, last_count: torch.Tensor, block_table: torch.Tensor, block_size: int) -> None:
        dev = self.stg.dev
        if shift_kernels.shift_apply(dev, staged["i64"].t, staged["i32"].t, staged["slots"].t, last_count, block_table,
                       block_size):
            return
        v64, v32 = dev.view(torch.int64), dev.view(torch.int32)
        # (Index arrays live in a staging buffer too, so they are copied before writing.)
        for key, view in (("i64", v64), ("i32", v32)):
            el, rows = staged[key].t
            if el.numel():
                view.index_add_(0, el.clone(), (last_count[rows] - 1).to(view.dtype))
        el, ci, rows = staged["slots"].t.clone()
        if el.numel():
            pos = ci + last_count[rows] - 1
            slot = block_table[rows, pos // block_size].long() * block_size + pos % block_size
            v64[el] = torch.where(v64[el] >= 0, slot, v64[el])
