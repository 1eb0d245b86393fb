"""Persistent device batch state and the per-step host->device staging.

`DeviceRows`: every running request owns a row (`req.row`) of preallocated device tensors
that persist across steps: its block table (int32, updated incrementally: only blocks the
device has not seen yet are sent) and its EAGLE-3 draft hidden state. Rows of requests that
stopped running are reclaimed lazily, when rows run out.

`Staging`: everything a step needs on the device (token ids, positions, slots, attention
metadata of every forward in the step, block-table updates, random draws) is packed into one
pinned host buffer and sent with ONE non-blocking copy; the device side is a set of views of
one static buffer. Fields are laid out in the order they are added, so a step whose target
forward has the same shape as a captured CUDA graph finds its metadata at the same
addresses the graph reads (the target's fields are always added first).
"""
from __future__ import annotations

import numpy as np
import torch

from adaspec.engine.request import Request, Status

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


class DeviceRows:
    """Per-request rows of persistent device state."""

    def __init__(self, num_rows: int, max_blocks: int, device: torch.device, draft_hidden: int | None,
                 dtype: torch.dtype):
        self.num_rows = num_rows
        self.block_table = torch.zeros(num_rows + 1, max_blocks, dtype=torch.int32, device=device)
        self.max_blocks = max_blocks
        self.draft_hidden = (torch.zeros(num_rows + 1, draft_hidden, dtype=dtype, device=device)
                             if draft_hidden else None)
        # The last token each row emitted and how many tokens it emitted, for steps planned
        # before they were read back (the input token, and the shift of its positions).
        self.last_token = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
        self.last_count = torch.ones(num_rows + 1, dtype=torch.int64, device=device)
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


def stage_forward(stg: Staging, backend, block_table: torch.Tensor, block_size: int, group: int, *,
                  q_lens, ctx_len, kv_start, req_row, positions, cache_index, slots, input_ids=None,
                  mask_start=None, mask_offset=None, mask=None, max_ctx_len=None,
                  shift: "Shift | None" = None, shift_rows=None, shift_reqs=None):
    """Stage one forward's inputs; returns (AttnMeta, input_ids or None, positions) as device
    views (valid once `stg.commit()` ran). Per-request arrays have one entry per request,
    per-row arrays one per query row (see AttnMeta for the meaning). With `shift`, the rows
    `shift_rows` = (row indices, device rows) and the requests `shift_reqs` = (request indices,
    device rows) get their positions, cache indices, slots, context lengths (and mask starts)
    corrected on the device (see `Shift`); `max_ctx_len` must then bound the shifted lengths."""
    from adaspec.layers.attention import AttnMeta, launch_plan

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


def _pad4(n: int) -> int:
    """n rounded up to a multiple of 4 (int32 elements per 16 bytes)."""
    return -(-n // 4) * 4


class Shift:
    """Staged metadata that depends on how many tokens the previous step emitted, for requests
    whose previous step is still in flight (overlap). The host stages as if that step emitted
    one token; `apply` then adds `last_count[row] - 1` on the device to each registered
    position-like entry and recomputes the registered slots from the shifted positions.

    Entries are addressed inside one staging buffer (every field lives in `stg.dev`), so the
    correction is a handful of device ops whatever the number of fields and draft steps."""

    def __init__(self, stg: Staging):
        self.stg = stg
        self.i64: list[np.ndarray] = []    # (element index in the int64 view, device row)
        self.i32: list[np.ndarray] = []    # the same, int32 view
        self.slots: list[np.ndarray] = []  # (slot element, position element, offset, device row)

    @staticmethod
    def _elements(ref: "_Ref", idx) -> np.ndarray:
        size = _ELEMENT_SIZE[ref.dtype]
        return ref.start // size + np.asarray(idx, dtype=np.int64)

    def add(self, ref: "_Ref", idx, rows) -> None:
        """Shift elements `idx` (flat, of `ref`) by the delta of device rows `rows`."""
        if len(idx):
            pair = np.stack([self._elements(ref, idx), np.asarray(rows, dtype=np.int64)])
            (self.i64 if ref.dtype == torch.int64 else self.i32).append(pair)

    def add_slots(self, slot_ref: "_Ref", idx, pos_ref: "_Ref", pos_idx, offset, rows) -> None:
        """Recompute slots `idx` of `slot_ref` as the slot of cache index pos_ref[pos_idx] +
        offset (after the shift; `offset` an int or one per slot), where they are not -1."""
        if len(idx):
            n = len(idx)
            self.slots.append(np.stack([self._elements(slot_ref, idx), self._elements(pos_ref, pos_idx),
                                        np.broadcast_to(np.asarray(offset, np.int64), (n,)),
                                        np.asarray(rows, dtype=np.int64)]))

    def __bool__(self) -> bool:
        return bool(self.i64 or self.i32 or self.slots)

    def stage(self, into: Staging) -> dict:
        """Stage the index arrays (into the step's buffer); returns handles for `apply`."""
        cat = (lambda parts, k: np.concatenate(parts, axis=1) if parts else np.zeros((k, 0), np.int64))
        return {"i64": into.add(cat(self.i64, 2), torch.int64), "i32": into.add(cat(self.i32, 2), torch.int64),
                "slots": into.add(cat(self.slots, 4), torch.int64)}

    def apply(self, staged: dict, last_count: torch.Tensor, block_table: torch.Tensor, block_size: int) -> None:
        from adaspec.engine.shift_kernels import shift_apply

        dev = self.stg.dev
        if shift_apply(dev, staged["i64"].t, staged["i32"].t, staged["slots"].t, last_count, block_table,
                       block_size):
            return
        v64, v32 = dev.view(torch.int64), dev.view(torch.int32)
        # (Index arrays live in a staging buffer too, so they are copied before writing.)
        for key, view in (("i64", v64), ("i32", v32)):
            el, rows = staged[key].t
            if el.numel():
                view.index_add_(0, el.clone(), (last_count[rows] - 1).to(view.dtype))
        el, pos_el, off, rows = staged["slots"].t.clone()
        if el.numel():
            pos = v64[pos_el] + off
            slot = block_table[rows, pos // block_size].long() * block_size + pos % block_size
            v64[el] = torch.where(v64[el] >= 0, slot, v64[el])
