"""The per-step host->device staging: ONE copy for everything a step needs.

`Staging`: everything a step needs on the device (token ids, positions, slots, attention
metadata of every forward in the step, block-table updates, random draws) is packed into one
pinned host buffer and sent with ONE non-blocking copy; the device side is a set of views of
one static buffer. Fields are laid out in the order they are added, so a step whose target
forward has the same shape as a captured CUDA graph finds its metadata at the same
addresses the graph reads (the target's fields are always added first).

`stage_forward` stages one forward's attention metadata. Policy-free: this floor knows
nothing of requests, plans or speculation; the engine and the drafters build on it.
"""
from __future__ import annotations

import numpy as np
import torch

from adaspec.layers.attention import AttnMeta, launch_plan

_ALIGN = 16
_NP_DTYPE = {torch.int64: np.int64, torch.int32: np.int32, torch.uint8: np.uint8, torch.float32: np.float32}


class Staging:
    """Double-buffered on the host: while step N's copy may still be queued behind step N-1
    on the device, step N+1 is written into the other pinned buffer (overlap). The device
    buffer is single (CUDA graphs read fixed addresses); stream order protects it."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        nbytes = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN   # whole elements of every dtype's view
        pin = device.type == "cuda"
        self.hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2 if pin else 1)]
        self.host_nps = [h.numpy() for h in self.hosts]
        self.copied = [None] * len(self.hosts)   # event: that buffer's last copy has run
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device) if pin else self.hosts[0]
        self.nbytes = nbytes
        self.which = 0
        self.host, self.host_np = self.hosts[0], self.host_nps[0]
        self.offset = 0
        # Device views by (start, size, dtype, shape): a step stages the same fields at the same
        # offsets as the last one, and building a view costs host time (several ops) per field.
        self.views: dict[tuple, torch.Tensor] = {}

    def view(self, start: int, size: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        key = (start, size, dtype, shape)
        t = self.views.get(key)
        if t is None:
            if len(self.views) >= 8192:   # layouts vary with the batch: keep the cache bounded
                self.views.clear()
            raw = self.dev[start: start + size * _ELEMENT_SIZE[dtype]]
            t = self.views[key] = raw.view(dtype).view(shape)
        return t

    def begin(self) -> None:
        self.which = (self.which + 1) % len(self.hosts)
        if self.copied[self.which] is not None:
            self.copied[self.which].synchronize()
        self.host, self.host_np = self.hosts[self.which], self.host_nps[self.which]
        self.offset = 0

    def add(self, array, dtype: torch.dtype) -> "_Ref":
        """Stage `array` (anything numpy accepts) as `dtype`; returns a handle whose `.t` is the
        device tensor after `commit()`."""
        a = np.asarray(array, dtype=_NP_DTYPE[dtype])
        n = a.nbytes
        start = self.offset
        end = start + n
        if end > self.nbytes:
            raise RuntimeError(f"step staging buffer overflow ({end} > {self.nbytes} bytes)")
        self.host_np[start:end] = a.reshape(-1).view(np.uint8)
        self.offset = (end + _ALIGN - 1) // _ALIGN * _ALIGN
        return _Ref(self, start, a.size, dtype, a.shape)

    def commit(self) -> None:
        """One host->device copy of everything staged since `begin()`."""
        if self.dev is not self.host and self.offset:
            self.dev[: self.offset].copy_(self.host[: self.offset], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.copied[self.which] = ev


_ELEMENT_SIZE = {torch.int64: 8, torch.int32: 4, torch.uint8: 1, torch.float32: 4}


class _Ref:
    """A staged array; `.t` is its device tensor (a view of the static buffer, built once)."""

    __slots__ = ("stg", "start", "size", "dtype", "shape", "_t")

    def __init__(self, stg: Staging, start: int, size: int, dtype: torch.dtype, shape: tuple):
        self.stg, self.start, self.size, self.dtype, self.shape = stg, start, size, dtype, shape
        self._t = None

    @property
    def t(self) -> torch.Tensor:
        if self._t is None:
            self._t = self.stg.view(self.start, self.size, self.dtype, self.shape)
        return self._t


def stage_forward(stg: Staging, backend, block_table: torch.Tensor, block_size: int, group: int, *,
                  q_lens, ctx_len, kv_start, req_row, positions, cache_index, slots, input_ids=None,
                  mask_start=None, mask_offset=None, mask=None, max_ctx_len=None,
                  shift=None, shift_rows=None, shift_reqs=None):
    """Stage one forward's inputs; returns (AttnMeta, input_ids or None, positions) as device
    views (valid once `stg.commit()` ran). Per-request arrays have one entry per request,
    per-row arrays one per query row (see AttnMeta for the meaning). With `shift`, the rows
    `shift_rows` = (row indices, device rows) and the requests `shift_reqs` = (request indices,
    device rows) get their positions, cache indices, slots, context lengths (and mask starts)
    corrected on the device (see `Shift`); `max_ctx_len` must then bound the shifted lengths."""
    q_lens = np.asarray(q_lens, dtype=np.int64)
    ctx = np.asarray(ctx_len, dtype=np.int64)
    max_q = int(q_lens.max()) if len(q_lens) else 0
    bq = backend.block_q(max(1, max_q), group, len(q_lens))
    prog_req, prog_q0 = launch_plan(q_lens, bq)
    qs = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qs[1:])
    ids = stg.add(input_ids, torch.int64) if input_ids is not None else None
    pos = stg.add(positions, torch.int64)
    slot = stg.add(slots, torch.int64)
    ci = stg.add(cache_index, torch.int32)
    # Rows of the per-request and per-program tables start on 16-byte boundaries: Triton
    # specializes a kernel on each pointer's alignment, so a row at 4 * n bytes would compile
    # another variant of the attention kernel for every batch size n mod 4, in the middle of
    # serving (seen as stalls of 0.4-0.7 s on the H200).
    n, n4 = len(ctx), _pad4(len(ctx))
    per_req = np.zeros((5, n4), dtype=np.int64)
    per_req[:, :n] = np.stack([ctx, np.asarray(kv_start), np.asarray(req_row),
                               ctx if mask_start is None else np.asarray(mask_start),
                               np.zeros_like(ctx) if mask_offset is None else np.asarray(mask_offset)])
    per_req = stg.add(per_req, torch.int32)
    q_start = stg.add(qs, torch.int32)
    P = len(prog_req)
    pg_host = np.zeros((2, _pad4(P)), dtype=np.int64)
    pg_host[:, :P] = np.stack([prog_req, prog_q0]) if P else 0
    progs = stg.add(pg_host, torch.int32)
    m = stg.add(mask if mask is not None and len(mask) else np.zeros(1), torch.uint8)
    if shift is not None:
        ri, rr = shift_rows
        shift.add(pos, ri, rr)
        shift.add(ci, ri, rr)
        # A row's slot is that of its cache index, `cache_index - position` past its position.
        off = np.asarray(cache_index, dtype=np.int64)[ri] - np.asarray(positions, dtype=np.int64)[ri]
        shift.add_slots(slot, ri, pos, ri, off, rr)
        qi, qr = np.asarray(shift_reqs[0], dtype=np.int64), shift_reqs[1]
        shift.add(per_req, qi, qr)                    # ctx_len
        shift.add(per_req, 3 * n4 + qi, qr)           # mask_start
    pr = per_req.t[:, :n]
    pg = progs.t[:, :P]
    meta = AttnMeta(
        positions=pos.t, cache_index=ci.t, slot_mapping=slot.t, query_start=q_start.t,
        ctx_len=pr[0], kv_start=pr[1], req_row=pr[2], mask_start=pr[3], mask_offset=pr[4],
        block_table=block_table, mask=m.t, prog_req=pg[0], prog_q0=pg[1], block_q=bq,
        block_size=block_size, max_q_len=max_q,
        max_ctx_len=max_ctx_len if max_ctx_len is not None else (int(ctx.max()) if len(ctx) else 0))
    return meta, (ids.t if ids is not None else None), pos.t


def stage_decode_steps(stg: Staging, backend, block_table: torch.Tensor, block_size: int, group: int, *,
                       ctx_len: np.ndarray, kv_start, req_row, positions: np.ndarray, cache_index: np.ndarray,
                       slots: np.ndarray, max_ctx_len: list[int], shift=None, shift_reqs=None) -> list:
    """Stage K forwards of one query row per request at once (chain draft steps): the per-step
    arrays are [K, B] and go in as one field each, so K forwards cost what one does on the
    host. Returns [(AttnMeta, positions)] per step, each step's fields views of row k (rows
    start on 16-byte boundaries, see `stage_forward`). With `shift`, the requests
    `shift_reqs` = (request indices, device rows) are corrected on the device in every step."""
    K, B = positions.shape
    b2, n4 = -(-B // 2) * 2, _pad4(B)
    bq = backend.block_q(1, group, B)
    prog_req, prog_q0 = launch_plan(np.ones(B, np.int64), bq)

    def padded(a, width, dtype=np.int64):
        out = np.zeros((K, width), dtype=dtype)
        out[:, :B] = a
        return out

    pos = stg.add(padded(positions, b2), torch.int64)
    slot = stg.add(padded(slots, b2), torch.int64)
    ci = stg.add(padded(cache_index, n4), torch.int32)
    per_req = np.zeros((K, 5, n4), dtype=np.int64)
    per_req[:, 0, :B] = ctx_len
    per_req[:, 1, :B] = np.asarray(kv_start)
    per_req[:, 2, :B] = np.asarray(req_row)
    per_req[:, 3, :B] = ctx_len
    per_req = stg.add(per_req, torch.int32)
    q_start = stg.add(np.arange(B + 1), torch.int32)
    P = len(prog_req)
    pg_host = np.zeros((2, _pad4(P)), dtype=np.int64)
    pg_host[:, :P] = np.stack([prog_req, prog_q0]) if P else 0
    progs = stg.add(pg_host, torch.int32)
    m = stg.add(np.zeros(1), torch.uint8)
    if shift is not None:
        qi, qr = np.asarray(shift_reqs[0], dtype=np.int64), list(shift_reqs[1])
        steps = np.arange(K)[:, None]
        rows = qr * K
        e2 = (steps * b2 + qi).reshape(-1)
        shift.add(pos, e2, rows)
        shift.add(ci, (steps * n4 + qi).reshape(-1), rows)
        shift.add_slots(slot, e2, pos, e2, 1, rows)   # a row's slot is that of position + 1
        shift.add(per_req, (steps * 5 * n4 + qi).reshape(-1), rows)            # ctx_len
        shift.add(per_req, (steps * 5 * n4 + 3 * n4 + qi).reshape(-1), rows)   # mask_start
    out = []
    pg = progs.t[:, :P]
    for k in range(K):
        pr = per_req.t[k, :, :B]
        meta = AttnMeta(
            positions=pos.t[k, :B], cache_index=ci.t[k, :B], slot_mapping=slot.t[k, :B], query_start=q_start.t,
            ctx_len=pr[0], kv_start=pr[1], req_row=pr[2], mask_start=pr[3], mask_offset=pr[4],
            block_table=block_table, mask=m.t, prog_req=pg[0], prog_q0=pg[1], block_q=bq,
            block_size=block_size, max_q_len=1, max_ctx_len=max_ctx_len[k])
        out.append((meta, meta.positions))
    return out


def _pad4(n: int) -> int:
    """n rounded up to a multiple of 4 (int32 elements per 16 bytes)."""
    return -(-n // 4) * 4
