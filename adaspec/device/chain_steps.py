"""The metadata of chain draft steps, derived on the device from five numbers per request.

A chain step drafts K tokens for each drafting request with K one-row forwards of the draft
head. Step i (0 <= i < K) of a request with n tokens (the root, its last token, at cache index
n - 1) feeds the pair at draft cache index c = n - 1 + i, rotary position c - 1, sees keys
1 .. c, and writes its KV at the slot of c while i < the request's own depth (else nowhere).
The pair's hidden state is the request's draft hidden (`draft_hidden[row]`), its token the root.

Every field is a function of (device row, n, depth, root token) and, for a request whose
previous step is still in flight, of what that step emitted: the host staged n as if it
emitted one token, the device knows how many it did (`last_count[row]`) and which was last
(`last_token[row]`). So the host stages a few numbers per request with the step's other
inputs (`stage`); on the device one copy brings them to a static buffer (`load`) and one
launch (`derive`) writes every step's positions, cache indices, slots and context lengths and
the draft's first hidden states and tokens into static buffers (`ChainSteps`). A captured
draft graph runs `derive` as its first kernel and, as its last, scatters the drafts to where
the step reads them (`scatter`: the target forward's input ids and the verify batch, both in
the step's staging buffer), so a chain step's drafting costs the host a copy and a replay.
Staging K steps of metadata on the host, shifting them on the device and routing the drafts
cost a host-bound step about 0.5 ms (the demo pair at batch 1 on the H200,
benchmarks/launch_anatomy.py).

Policy-free, like the rest of this floor: requests are rows of numbers here.

Input rows, one column per request, padding requests included (`INPUTS` rows, then 2K):
    row     device row (its block-table row, draft hidden and last token / count)
    n       its tokens as the host counts them (a step in flight counted as one)
    depth   its own draft depth: steps i >= depth write no KV (0 for padding)
    token   its root token, where the host knows it
    flags   REAL (1: not padding; padding sees no key and writes nothing)
            | SHIFTED (2: the step in flight may have emitted more than one: n moves by
              last_count[row] - 1) | DEVICE_TOKEN (4: the root is last_token[row])
    dst     2K rows: the int64 elements of the staging buffer that draft k of the request
            goes to (its input id in the target forward, its token in the verify batch);
            padding requests name a sink element nothing reads
"""
from __future__ import annotations

import numpy as np
import torch

from adaspec.device import shift_kernels
from adaspec.device.shift import Shift, apply_packed
from adaspec.device.staging import Staging, _pad4, align16
from adaspec.layers.attention import AttnMeta
from adaspec.layers.fused_ops import _next_pow2, triton, use_triton

INPUTS = 5
REAL, SHIFTED, DEVICE_TOKEN = 1, 2, 4

if triton is not None:
    import triton.language as tl

    # Batch-dependent sizes are not specialised on: one compile serves every step.
    @triton.jit(do_not_specialize=["stride_in", "K"])
    def _chain_steps_kernel(inp_ptr, stride_in, K, pos_ptr, slot_ptr, ci_ptr, ctx_ptr, req_row_ptr, h0_ptr, tok0_ptr,
                            last_count_ptr, last_token_ptr, hidden_ptr, block_table_ptr, stride_bt, stride_hid,
                            stride_h0, W, H, BLOCK_SIZE: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
        j = tl.program_id(0)
        row = tl.load(inp_ptr + j)
        n = tl.load(inp_ptr + stride_in + j)
        depth = tl.load(inp_ptr + 2 * stride_in + j)
        tok = tl.load(inp_ptr + 3 * stride_in + j)
        flags = tl.load(inp_ptr + 4 * stride_in + j)
        real = (flags & 1) != 0
        count = tl.load(last_count_ptr + row)
        delta = tl.where((flags & 2) != 0, count - 1, 0)
        tok = tl.where((flags & 4) != 0, tl.load(last_token_ptr + row), tok)
        i = tl.arange(0, K_PAD)
        ok = i < K
        c = n - 1 + delta + i
        tl.store(pos_ptr + i * W + j, c - 1, mask=ok)
        tl.store(ci_ptr + i * W + j, c.to(tl.int32), mask=ok)
        tl.store(ctx_ptr + i * W + j, tl.where(real, c + 1, 0).to(tl.int32), mask=ok)
        writes = ok & (i < tl.where(real, depth, 0))   # padding writes nothing
        page = tl.load(block_table_ptr + row * stride_bt + c // BLOCK_SIZE, mask=writes, other=0)
        slot = tl.where(writes, page.to(tl.int64) * BLOCK_SIZE + c % BLOCK_SIZE, -1)
        tl.store(slot_ptr + i * W + j, slot, mask=ok)
        tl.store(req_row_ptr + j, row.to(tl.int32))
        tl.store(tok0_ptr + j, tok)
        for h in range(0, H, BLOCK_H):
            d = h + tl.arange(0, BLOCK_H)
            x = tl.load(hidden_ptr + row * stride_hid + d, mask=d < H)
            tl.store(h0_ptr + j * stride_h0 + d, x, mask=d < H)


def _shift_at(K: int, b: int) -> int:
    """Byte offset of the packed shift from the inputs: after them and the sink (`stage`)."""
    return align16(align16(8 * (INPUTS + 2 * K) * b) + 8)


def shift_bound(b: int, K: int) -> int:
    """The most entries of each kind (int64, int32, slots) the in-flight shift of a step of b
    requests with chains of K registers: per request, its 1 + K target rows' positions, cache
    indices and slots, its context length and mask start, and its 1 + K draft-refresh pairs'
    positions and slots (engine: step_layout, draft_refresh)."""
    return b * (2 * K + 3)


class ChainSteps:
    """Static device buffers of up to `max_batch` requests x `max_k` chain draft steps (their
    inputs, attention metadata and the draft's first inputs), filled by `load` and `derive`,
    read through `steps`. `last_count`, `last_token`, `draft_hidden` and `block_table` are the
    engine's persistent per-row device state (engine/device_rows.py), and `stg` the step's
    staging buffer: read and written in place, so a graph that captured `apply_shift`,
    `derive` and `scatter` finds them at replay."""

    def __init__(self, max_batch: int, max_k: int, backend, group: int, block_size: int, block_table: torch.Tensor,
                 last_count: torch.Tensor, last_token: torch.Tensor, draft_hidden: torch.Tensor, stg: Staging):
        dev = block_table.device
        self.max_batch, self.max_k = max_batch, max_k
        self.backend, self.group, self.block_size = backend, group, block_size
        self.block_table, self.last_count, self.last_token, self.hidden = block_table, last_count, last_token, draft_hidden
        self.stg, self.flat = stg, stg.dev_as(torch.int64)
        # Rows of W elements: every row of every field starts on a 16-byte boundary (Triton
        # specialises kernels on pointer alignment; see device/staging.py).
        W = self.W = _pad4(max_batch)
        i32 = dict(dtype=torch.int32, device=dev)
        # The loaded inputs (`load`): the staged field, then the step's packed shift when the
        # draft graph applies it, copied as they were staged (one copy).
        self.static = torch.zeros(_shift_at(max_k, max_batch) + 8 * (shift_kernels.HEADER + 7 * shift_bound(max_batch, max_k)),
                                  dtype=torch.uint8, device=dev)
        self.pos = torch.zeros(max_k, W, dtype=torch.int64, device=dev)
        self.slot = torch.full((max_k, W), -1, dtype=torch.int64, device=dev)
        self.ci = torch.zeros(max_k, W, **i32)
        self.ctx = torch.zeros(max_k, W, **i32)   # also each step's mask start: no tree region
        self.req_row = torch.zeros(W, **i32)
        self.h0 = torch.zeros(max_batch, draft_hidden.shape[1], dtype=draft_hidden.dtype, device=dev)
        self.tok0 = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        # Constant fields: one query row per request, keys from 1 (draft slot 0 is never read).
        self.query_start = torch.arange(_pad4(W + 1), **i32)
        self.prog_req = torch.arange(W, **i32)
        self.kv_start = torch.ones(W, **i32)
        self.zeros = torch.zeros(W, **i32)
        self.mask = torch.zeros(16, dtype=torch.uint8, device=dev)
        self._steps: dict[tuple, list] = {}

    # ---- host -------------------------------------------------------------------------------
    @staticmethod
    def stage(stg: Staging, K: int, rows: list, ns: list, depths: list, tokens: list, flags: list,
              dst_ids, dst_tokens, pad: int, pad_row: int, shift: Shift | None = None):
        """Stage the inputs of len(rows) drafting requests and `pad` padding ones as one
        [INPUTS + 2K, b] field of `stg` and a sink element; `dst_ids` / `dst_tokens` [B, K]:
        the int64 elements of `stg` their drafts go to. With `shift` (complete: every entry
        registered), its packed arrays follow, for the draft graph to apply. Returns the handles
        (inputs, packed shift or None)."""
        B = len(rows)
        h, ref = stg.reserve((INPUTS + 2 * K, B + pad), torch.int64)
        sink = stg.reserve((1,), torch.int64)[1].start // 8   # where padding's drafts go
        h[0, :B], h[1, :B], h[2, :B], h[3, :B], h[4, :B] = rows, ns, depths, tokens, flags
        h[INPUTS: INPUTS + K, :B] = np.asarray(dst_ids).T
        h[INPUTS + K:, :B] = np.asarray(dst_tokens).T
        if pad:
            h[:INPUTS, B:] = np.array([[pad_row], [2], [0], [0], [0]])
            h[INPUTS:, B:] = sink
        if shift is None:
            return ref, None
        packed = shift.stage(stg)
        if packed.start - ref.start != _shift_at(K, B + pad):   # (what `packed_shift` reads)
            raise RuntimeError("chain steps: the packed shift is not staged right after the inputs")
        return ref, packed

    @classmethod
    def stage_padding(cls, stg: Staging, b: int, K: int, pad_row: int, shift: Shift | None = None):
        """b padding requests (what draft graphs are captured on)."""
        return cls.stage(stg, K, [], [], [], [], [], np.zeros((0, K)), np.zeros((0, K)), b, pad_row, shift)

    def steps(self, b: int, K: int, max_ctx_len: int) -> list:
        """[(AttnMeta, positions)] of the K steps of b requests, views of the buffers
        (`max_ctx_len`: a host bound of every step's context, split-KV sizing)."""
        key = (b, K, max_ctx_len)
        out = self._steps.get(key)
        if out is None:
            if len(self._steps) >= 4096:
                self._steps.clear()
            bq = self.backend.block_q(1, self.group, b)   # 1: one program per request
            zeros = self.zeros[:b]
            out = self._steps[key] = [(AttnMeta(
                positions=self.pos[k, :b], cache_index=self.ci[k, :b], slot_mapping=self.slot[k, :b],
                query_start=self.query_start[:b + 1], ctx_len=self.ctx[k, :b], kv_start=self.kv_start[:b],
                req_row=self.req_row[:b], mask_start=self.ctx[k, :b], mask_offset=zeros, block_table=self.block_table,
                mask=self.mask, prog_req=self.prog_req[:b], prog_q0=zeros, block_q=bq, block_size=self.block_size,
                max_q_len=1, max_ctx_len=max_ctx_len), self.pos[k, :b]) for k in range(K)]
        return out

    # ---- device -----------------------------------------------------------------------------
    def inputs(self, K: int, b: int) -> torch.Tensor:
        """The loaded inputs of K steps of b requests [INPUTS + 2K, b] (a view of the static buffer)."""
        return self.static[: 8 * (INPUTS + 2 * K) * b].view(torch.int64).view(INPUTS + 2 * K, b)

    def packed_shift(self, K: int, b: int) -> torch.Tensor:
        """The loaded packed shift of the same steps (where `stage` put it: after the inputs
        and the sink, on a 16-byte boundary), at its largest size."""
        at = _shift_at(K, b)
        return self.static[at: at + 8 * (shift_kernels.HEADER + 7 * shift_bound(self.max_batch, K))].view(torch.int64)

    def load(self, inputs, shift=None) -> None:
        """Copy a step's staged inputs (and packed shift) into the static buffer: one copy of
        the bytes they span in the staging buffer (outside any graph: their address there
        varies from step to step)."""
        stg = inputs.stg
        end = (shift or inputs).start + 8 * (shift or inputs).size
        self.static[: end - inputs.start].copy_(stg.dev[inputs.start: end])

    def apply_shift(self, K: int, b: int) -> None:
        """Apply the loaded packed shift to the step's staging buffer: a launch sized for the
        most entries a step of chains of K registers (`shift_bound` of the largest batch: the
        step may hold requests that do not draft); graph-safe."""
        apply_packed(self.stg, self.packed_shift(K, b), shift_bound(self.max_batch, K), self.last_count,
                     self.block_table, self.block_size)

    def derive(self, K: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the buffers of K steps of b requests from the loaded inputs; returns the draft's
        first inputs (hidden [b, H], token [b]), views of the buffers. Device work only."""
        if not 0 < b <= self.max_batch or not 0 < K <= self.max_k:
            raise ValueError(f"chain steps: {b} requests x {K} steps outside {self.max_batch} x {self.max_k}")
        inputs = self.inputs(K, b)
        if use_triton(inputs):
            H = self.hidden.shape[1]
            _chain_steps_kernel[(b,)](
                inputs, b, K, self.pos, self.slot, self.ci, self.ctx, self.req_row, self.h0, self.tok0,
                self.last_count, self.last_token, self.hidden, self.block_table, self.block_table.stride(0),
                self.hidden.stride(0), self.h0.stride(0), self.W, H, BLOCK_SIZE=self.block_size,
                K_PAD=max(2, _next_pow2(self.max_k)), BLOCK_H=min(1024, _next_pow2(H)))
        else:
            self._derive_torch(inputs, K, b)
        return self.h0[:b], self.tok0[:b]

    def scatter(self, drafts: torch.Tensor) -> None:
        """Write drafts [b, K] to the staging elements the loaded inputs name (one op)."""
        b, K = drafts.shape
        dst = self.inputs(K, b)[INPUTS:]
        self.flat.index_copy_(0, dst.reshape(-1), drafts.t().repeat(2, 1).reshape(-1))

    def warm_up(self, stg: Staging, pad_row: int) -> int:
        """Compile the kernel before serving (graph capture does too, but not an eager engine):
        one padding request, one step. Returns the launches made."""
        stg.begin()
        ref, _ = self.stage_padding(stg, 1, 1, pad_row)
        stg.commit()
        self.load(ref)
        self.derive(1, 1)
        return 1

    def _derive_torch(self, inputs: torch.Tensor, K: int, b: int) -> None:
        """`derive` in PyTorch ops (CPU; the reference the kernel is tested against)."""
        row, n, depth, tok, flags = inputs[:INPUTS]
        real = (flags & REAL) != 0
        delta = torch.where((flags & SHIFTED) != 0, self.last_count[row] - 1, 0)
        c = (n - 1 + delta)[None, :] + torch.arange(K, device=row.device)[:, None]   # [K, b]
        self.pos[:K, :b] = c - 1
        self.ci[:K, :b] = c.to(torch.int32)
        self.ctx[:K, :b] = torch.where(real, c + 1, 0).to(torch.int32)
        writes = real & (torch.arange(K, device=row.device)[:, None] < depth)
        page = self.block_table[row.expand(K, b), (c // self.block_size).clamp(0, self.block_table.shape[1] - 1)]
        self.slot[:K, :b] = torch.where(writes, page.long() * self.block_size + c % self.block_size, -1)
        self.req_row[:b] = row.to(torch.int32)
        self.tok0[:b] = torch.where((flags & DEVICE_TOKEN) != 0, self.last_token[row], tok)
        self.h0[:b] = self.hidden[row]
