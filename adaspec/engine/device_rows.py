"""Persistent per-request device rows.

`DeviceRows`: every running request owns a row (`req.row`) of preallocated device tensors
that persist across steps: its block table (int32, updated incrementally: only blocks the
device has not seen yet are sent) and its EAGLE-3 draft hidden state. Rows of requests that
stopped running are reclaimed lazily, when rows run out.
"""
from __future__ import annotations

import numpy as np
import torch

from adaspec.engine.request import Request, Status


class DeviceRows:
    """Per-request rows of persistent device state."""

    def __init__(self, num_rows: int, max_blocks: int, device: torch.device, draft_hidden: int | None,
                 dtype: torch.dtype, emitted_width: int = 1):
        self.num_rows = num_rows
        self.block_table = torch.zeros(num_rows + 1, max_blocks, dtype=torch.int32, device=device)
        self.max_blocks = max_blocks
        self.draft_hidden = (torch.zeros(num_rows + 1, draft_hidden, dtype=dtype, device=device)
                             if draft_hidden else None)
        # The last token each row emitted and how many tokens it emitted, for steps planned
        # before they were read back (the input token, and the shift of its positions).
        self.last_token = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
        self.last_count = torch.ones(num_rows + 1, dtype=torch.int64, device=device)
        # ... and every token of that step (the first `last_count`): the penalties of a step
        # planned before they were read back count them (engine/penalty_step.py).
        self.last_emitted = torch.zeros(num_rows + 1, emitted_width, dtype=torch.int64, device=device)
        self.owner: list[Request | None] = [None] * num_rows
        self.free = list(range(num_rows - 1, -1, -1))
        self.pad_row = num_rows  # the row of padding requests of CUDA graphs (the runner maps its blocks)

    def row_of(self, req: Request) -> int:
        if req.row >= 0 and self.owner[req.row] is req:
            return req.row
        if not self.free:
            self._reclaim()
        row = self.free.pop()
        self.owner[row] = req
        req.row = row
        req.table_synced = 0
        return row

    def _reclaim(self) -> None:
        for row, r in enumerate(self.owner):
            if r is not None and r.status != Status.RUNNING:
                self.owner[row] = None
                r.row = -1
                self.free.append(row)
        if not self.free:
            raise RuntimeError("more running requests than device rows")

    def table_updates(self, reqs: list[Request]) -> np.ndarray | None:
        """Flat (index, block) pairs of block-table entries the device has not seen."""
        idx, val = [], []
        for r in reqs:
            n = len(r.block_ids)
            if r.table_synced < n:
                if n > self.max_blocks:
                    raise RuntimeError(f"request {r.request_id} needs {n} blocks > table width {self.max_blocks}")
                base = r.row * self.max_blocks
                idx.extend(range(base + r.table_synced, base + n))
                val.extend(r.block_ids[r.table_synced:])
                r.table_synced = n
        if not idx:
            return None
        return np.array([idx, val], dtype=np.int64)

    def apply_updates(self, upd: torch.Tensor | None) -> None:
        if upd is not None:
            self.block_table.view(-1).index_copy_(0, upd[0], upd[1].to(torch.int32))
