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

    def counts(self) -> tuple[int, int, int]:
        """Entries registered: (int64, int32, slots)."""
        return tuple(sum(len(p[0]) for p in parts) for parts in (self.i64, self.i32, self.slots))

    def stage(self, into: Staging) -> "_Ref":
        """Stage the index arrays packed as one int64 field of `into` (the step's buffer): the
        counts (n64, n32, ns), then [2, n64] (element, row), [2, n32], [3, ns] (element, cache
        index, row). Returns its handle, for `apply` (or a graph that captured the kernel)."""
        n64, n32, ns = self.counts()
        h, ref = into.reserve((shift_kernels.HEADER + 2 * n64 + 2 * n32 + 3 * ns,), torch.int64)
        h[: shift_kernels.HEADER] = (n64, n32, ns)
        at = shift_kernels.HEADER
        for parts, k, n in ((self.i64, 2, n64), (self.i32, 2, n32), (self.slots, 3, ns)):
            block = h[at: at + k * n].reshape(k, n)
            col = 0
            for p in parts:
                m = len(p[0])
                for r in range(k):
                    block[r, col: col + m] = p[r]
                col += m
            at += k * n
        return ref

    def apply(self, staged: "_Ref", last_count: torch.Tensor, block_table: torch.Tensor, block_size: int) -> None:
        """Correct the staged entries on the device (after the step's block-table updates)."""
        apply_packed(self.stg, staged.t, max(self.counts()), last_count, block_table, block_size)


def apply_packed(stg: Staging, packed: torch.Tensor, max_entries: int, last_count: torch.Tensor,
                 block_table: torch.Tensor, block_size: int) -> None:
    """Apply a packed shift (`Shift.stage`'s layout) to `stg`'s device buffer: one Triton
    launch sized for `max_entries` per part (the counts are read on the device, so a CUDA graph
    may capture it), else PyTorch ops (which read the counts on the host)."""
    v64, v32 = stg.dev_as(torch.int64), stg.dev_as(torch.int32)
    if shift_kernels.shift_apply(v64, v32, packed, max_entries, last_count, block_table, block_size):
        return
    # (Index arrays live in a staging buffer too, so they are copied before writing.)
    packed = packed.clone()
    n64, n32, ns = packed[: shift_kernels.HEADER].tolist()
    at = shift_kernels.HEADER
    for view, n in ((v64, n64), (v32, n32)):
        el, rows = packed[at: at + 2 * n].view(2, n)
        if n:
            view.index_add_(0, el, (last_count[rows] - 1).to(view.dtype))
        at += 2 * n
    el, ci, rows = packed[at: at + 3 * ns].view(3, ns)
    if ns:
        pos = ci + last_count[rows] - 1
        slot = block_table[rows, pos // block_size].long() * block_size + pos % block_size
        v64[el] = torch.where(v64[el] >= 0, slot, v64[el])
