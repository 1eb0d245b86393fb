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

import math
from itertools import accumulate
from typing import NamedTuple

import numpy as np
import torch

from adaspec.layers.attention import AttnMeta, launch_plan

_ALIGN = 16
_NP_DTYPE = {torch.int64: np.int64, torch.int32: np.int32, torch.uint8: np.uint8, torch.float32: np.float32}


def align16(nbytes: int) -> int:
    """`nbytes` rounded up to a whole number of 16-byte units (where every field starts)."""
    return -(-nbytes // _ALIGN) * _ALIGN


class Staging:
    """Double-buffered on the host: while step N's copy may still be queued behind step N-1
    on the device, step N+1 is written into the other pinned buffer (overlap). The device
    buffer is single (CUDA graphs read fixed addresses); stream order protects it."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        nbytes = align16(nbytes)   # whole elements of every dtype's view
        pin = device.type == "cuda"
        self.hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2 if pin else 1)]
        self.host_nps = [h.numpy() for h in self.hosts]
        self.copied = [None] * len(self.hosts)   # event: that buffer's last copy has run
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device) if pin else self.hosts[0]
        self.nbytes = nbytes
        self.which = 0
        self.host, self.host_np = self.hosts[0], self.host_nps[0]
        # Each host buffer viewed as every staged dtype: fields start on 16-byte boundaries, so
        # a field is whole elements of its dtype and is written with one typed assignment.
        self.typed_views = [{dt: h.view(npdt) for dt, npdt in _NP_DTYPE.items()} for h in self.host_nps]
        self.typed = self.typed_views[0]
        self.offset = 0
        # Device views by (start, size, dtype, shape): a step stages the same fields at the same
        # offsets as the last one, and building a view costs host time (several ops) per field.
        self.views: dict[tuple, torch.Tensor] = {}
        self.derived: dict[tuple, object] = {}   # views built from views (`derive`), the same way
        self._as: dict[torch.dtype, torch.Tensor] = {}

    def dev_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole device buffer as `dtype` elements (one view per dtype, built once)."""
        t = self._as.get(dtype)
        if t is None:
            t = self._as[dtype] = self.dev.view(dtype)
        return t

    def view(self, start: int, size: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        key = (start, size, dtype, shape)
        t = self.views.get(key)
        if t is None:
            if len(self.views) >= 8192:   # layouts vary with the batch: keep the cache bounded
                self.views.clear()
            raw = self.dev[start: start + size * _ELEMENT_SIZE[dtype]]
            t = self.views[key] = raw.view(dtype).view(shape)
        return t

    def derive(self, key: tuple, build):
        """`build()` (views of staged fields, e.g. the rows of a table), cached under `key`,
        which must name everything the views depend on (their fields' starts and shapes, the
        slices taken): like `view`, a step that stages the same layout reuses them."""
        out = self.derived.get(key)
        if out is None:
            if len(self.derived) >= 8192:
                self.derived.clear()
            out = self.derived[key] = build()
        return out

    def begin(self) -> None:
        self.which = (self.which + 1) % len(self.hosts)
        if self.copied[self.which] is not None:
            self.copied[self.which].synchronize()
        self.host, self.host_np = self.hosts[self.which], self.host_nps[self.which]
        self.typed = self.typed_views[self.which]
        self.offset = 0

    def reserve(self, shape: tuple, dtype: torch.dtype) -> tuple[np.ndarray, "_Ref"]:
        """Room for a field of `shape` and `dtype` at the next 16-byte boundary: (its host view,
        for the caller to fill before `commit()`, with no intermediate array; its handle).
        Elements left unfilled hold whatever the buffer held: views must not read them."""
        size = _ELEMENT_SIZE[dtype]
        n = math.prod(shape)
        start = self.offset
        end = start + n * size
        if end > self.nbytes:
            raise RuntimeError(f"step staging buffer overflow ({end} > {self.nbytes} bytes)")
        self.offset = align16(end)
        el = start // size
        return self.typed[dtype][el: el + n].reshape(shape), _Ref(self, start, n, dtype, shape)

    def add_eager(self, array, dtype: torch.dtype, keep_free: int = 1 << 16):
        """`add`, for a field only eager code reads (no graph replays it from the buffer): one
        that would leave less than `keep_free` bytes for the step's later fields is copied to
        the device on its own instead. Returns a handle with `.t` either way."""
        a = np.asarray(array, dtype=_NP_DTYPE[dtype])
        if align16(self.offset) + a.nbytes + keep_free <= self.nbytes:
            return self.add(a, dtype)
        return _Copied(torch.from_numpy(a).to(self.dev.device))

    def add(self, array, dtype: torch.dtype) -> "_Ref":
        """Stage `array` (anything numpy accepts) as `dtype`; returns a handle whose `.t` is the
        device tensor after `commit()`."""
        a = np.asarray(array, dtype=_NP_DTYPE[dtype])
        view, ref = self.reserve(a.shape, dtype)
        view[...] = a
        return ref

    def add_rows(self, rows, dtype: torch.dtype) -> list["_Ref"]:
        """Stage each row of `rows` ([k, n], anything numpy accepts) as a field of its own, on
        its own 16-byte boundary: the bytes k `add`s of the rows would write, in one copy."""
        a = np.asarray(rows, dtype=_NP_DTYPE[dtype])
        k, n = a.shape
        size = _ELEMENT_SIZE[dtype]
        width = align16(n * size) // size   # a row padded to 16 bytes
        view, ref = self.reserve((k, width), dtype)
        view[:, :n] = a
        step = width * size
        return [_Ref(self, ref.start + i * step, n, dtype, (n,)) for i in range(k)]

    def commit(self) -> None:
        """One host->device copy of everything staged since `begin()`."""
        if self.dev is not self.host and self.offset:
            self.dev[: self.offset].copy_(self.host[: self.offset], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.copied[self.which] = ev


_ELEMENT_SIZE = {torch.int64: 8, torch.int32: 4, torch.uint8: 1, torch.float32: 4}


class _Copied:
    """A field copied to the device on its own (`Staging.add_eager`)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


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


class FixedLaunch(NamedTuple):
    """A forward staged at one shape for any mix of requests (a token graph's, captured once):
    the attention launch plan's rows per program and number of programs, and the bytes kept
    for tree masks, so every field lies where the capture put it and spans what it did; and
    the split-KV factor its attention launches with."""

    block_q: int
    programs: int
    mask_room: int
    num_splits: int | None = None   # the attention's split-KV factor (None: chosen per launch)


def max_programs(rows: int, slots: int, block_q: int) -> int:
    """The most attention programs `launch_plan` gives `rows` query rows spread over at most
    `slots` requests, `block_q` rows a program: each request that owns rows adds at most one
    partial program, and no more requests own rows than there are rows."""
    return -(-rows // block_q) + min(rows, slots)


def stage_forward(stg: Staging, backend, block_table: torch.Tensor, block_size: int, group: int, *,
                  q_lens: list, ctx_len, kv_start, req_row, positions, cache_index, slots, input_ids=None,
                  mask_start=None, mask_offset=None, mask=None, max_ctx_len=None,
                  shift=None, shift_rows=None, shift_reqs=None, launch: FixedLaunch | None = None):
    """Stage one forward's inputs; returns (AttnMeta, input_ids or None, positions) as device
    views (valid once `stg.commit()` ran). Per-request arrays have one entry per request
    (`kv_start` and `mask_offset` may be one int for all), per-row arrays one per query row
    (see AttnMeta for the meaning); lists or numpy arrays, written straight into the staging
    buffer. With `shift`, the rows
    `shift_rows` = (row indices, device rows) and the requests `shift_reqs` = (request indices,
    device rows) get their positions, cache indices, slots, context lengths (and mask starts)
    corrected on the device (see `Shift`); `max_ctx_len` must then bound the shifted lengths.
    `launch` fixes the shape (`FixedLaunch`): the plan is padded to `launch.programs` with
    programs of the last request, which must own no rows (they exit at once), and the tree masks
    get `launch.mask_room` bytes whatever their size."""
    n = len(q_lens)
    max_q = max(q_lens, default=0)
    bq = launch.block_q if launch is not None else backend.block_q(max(1, max_q), group, n)
    prog_req, prog_q0 = launch_plan(q_lens, bq)
    if launch is not None:
        P = launch.programs
        mask_len = len(mask) if mask is not None else 0
        if len(prog_req) > P or q_lens[-1] or mask_len > launch.mask_room:
            raise ValueError(f"stage_forward: {len(prog_req)} programs of block_q {bq} and {mask_len} mask bytes "
                             f"do not fit a fixed launch of {P} programs padded with an empty last request (it "
                             f"owns {q_lens[-1]} rows) and {launch.mask_room} mask bytes")
        prog_req = np.concatenate([prog_req, np.full(P - len(prog_req), n - 1, np.int32)])
        prog_q0 = np.concatenate([prog_q0, np.zeros(P - len(prog_q0), np.int32)])
    ids = _put(stg, input_ids, torch.int64)[1] if input_ids is not None else None
    pos = _put(stg, positions, torch.int64)[1]
    slot = _put(stg, slots, torch.int64)[1]
    ci_h, ci = _put(stg, cache_index, torch.int32)
    # Rows of the per-request and per-program tables start on 16-byte boundaries: Triton
    # specializes a kernel on each pointer's alignment, so a row at 4 * n bytes would compile
    # another variant of the attention kernel for every batch size n mod 4, in the middle of
    # serving (seen as stalls of 0.4-0.7 s on the H200).
    n4 = _pad4(n)
    rq, per_req = stg.reserve((5, n4), torch.int32)
    rq[0, :n] = ctx_len
    rq[1, :n] = kv_start
    rq[2, :n] = req_row
    rq[3, :n] = rq[0, :n] if mask_start is None else mask_start
    rq[4, :n] = 0 if mask_offset is None else mask_offset
    rq[:, n:] = 0
    qs, q_start = stg.reserve((n + 1,), torch.int32)
    qs[0] = 0
    qs[1:] = list(accumulate(q_lens))
    P = len(prog_req)
    pg_h, progs = stg.reserve((2, _pad4(P)), torch.int32)
    pg_h[0, :P] = prog_req
    pg_h[1, :P] = prog_q0
    pg_h[:, P:] = 0
    if launch is not None:
        m_h, m = stg.reserve((launch.mask_room,), torch.uint8)
        m_h[0] = 0
        if mask is not None:
            m_h[:len(mask)] = mask
    elif mask is not None and len(mask):
        m = stg.add(mask, torch.uint8)
    else:
        m_h, m = stg.reserve((1,), torch.uint8)
        m_h[0] = 0
    if shift is not None:
        ri, rr = (np.asarray(a, dtype=np.int64) for a in shift_rows)   # converted once, used thrice
        shift.add(pos, ri, rr)
        shift.add(ci, ri, rr)
        # A row's slot is that of its (shifted) cache index.
        shift.add_slots(slot, ri, ci_h[ri], rr)
        qi, qr = (np.asarray(a, dtype=np.int64) for a in shift_reqs)
        shift.add(per_req, qi, qr)                    # ctx_len
        shift.add(per_req, 3 * n4 + qi, qr)           # mask_start
    pr, pg = stg.derive(("forward", per_req.start, n4, n, progs.start, P),
                        lambda: (tuple(per_req.t[:, :n]), tuple(progs.t[:, :P])))
    meta = AttnMeta(
        positions=pos.t, cache_index=ci.t, slot_mapping=slot.t, query_start=q_start.t,
        ctx_len=pr[0], kv_start=pr[1], req_row=pr[2], mask_start=pr[3], mask_offset=pr[4],
        block_table=block_table, mask=m.t, prog_req=pg[0], prog_q0=pg[1], block_q=bq,
        block_size=block_size, max_q_len=max_q, num_splits=launch.num_splits if launch is not None else None,
        max_ctx_len=max_ctx_len if max_ctx_len is not None else (int(np.max(ctx_len)) if n else 0))
    return meta, (ids.t if ids is not None else None), pos.t


def _put(stg: Staging, values, dtype: torch.dtype) -> tuple[np.ndarray, _Ref]:
    """Stage a 1-D list or array; (its host view, its handle)."""
    h, ref = stg.reserve((len(values),), dtype)
    h[:] = np.asarray(values, dtype=h.dtype)   # (numpy converts a list faster this way than in an assignment)
    return h, ref


def _pad4(n: int) -> int:
    """n rounded up to a multiple of 4 (int32 elements per 16 bytes)."""
    return -(-n // 4) * 4
