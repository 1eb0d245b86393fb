"""Token-to-expert alignment of the fused-MoE aligned path, on the device, without a host sync.

For ids [T, k] (N = T*k (token, slot) pairs) it returns every expert's pairs in rows padded to
BLOCK_M, and per padded block its expert and valid row count. An id of -1 (the slot's expert is
on another rank: expert parallelism) places no pair. Buffers have fixed maximum sizes
(cdiv(N, BLOCK_M) + min(E, N) blocks), so CUDA graphs capture it. Pairs keep their order within
an expert and experts come in ascending order; rows past a block's valid count are unwritten.

Two implementations with the same output, picked by N (`ONE_PROGRAM_MAX_PAIRS`):
    one program   a single launch that counts, lays out the blocks and places the pairs in
                  chunks; cheapest for decode-sized N, but serial: its two passes over the
                  pairs run on one SM, so its cost grows with N.
    chunked       two launches over chunks of CH pairs: each chunk's per-expert histogram,
                  then each chunk places its pairs after the ones of the chunks before it
                  (the sum of their histograms), and lays out a stride of the blocks. Work
                  per program is one chunk plus a pass over the histograms (C x E ints).
"""
from __future__ import annotations

import torch

from adaspec.layers.fused_ops import _next_pow2, triton

if triton is not None:
    import triton.language as tl

# Above this many pairs the chunked alignment runs. benchmarks/kernels/moe_sweep.py times both
# ("align_one_us" / "align_chunked_us"); H200, E = 128, session 7 call 1 (us, one program /
# chunked): 64 pairs 15.1 / 11.1, 128: 23.9 / 10.1, 512: 59.4 / 10.2, 2048: 205 / 10.7,
# 8192: 828 / 34.1. The one program only stays for the few pairs below what was measured.
ONE_PROGRAM_MAX_PAIRS = 32


if triton is not None:

    @triton.jit
    def _blocks_of(counts, e, BM: tl.constexpr):
        """(first block, one past the last block) of each expert for `counts` [E_PAD]."""
        blocks = (counts + BM - 1) // BM
        first = tl.cumsum(blocks, axis=0) - blocks
        return first, first + blocks

    @triton.jit
    def _write_blocks(block_expert_ptr, block_rows_ptr, b, counts, first, last, e, max_blocks, BM: tl.constexpr):
        """Expert (-1: unused) and valid rows of blocks `b` [BLK]."""
        inside = (b[:, None] >= first[None, :]) & (b[:, None] < last[None, :])
        has = tl.sum(inside.to(tl.int32), axis=1) > 0
        expert = tl.sum(tl.where(inside, e[None, :], 0), axis=1)
        rows = tl.sum(tl.where(inside, counts[None, :] - (b[:, None] - first[None, :]) * BM, 0), axis=1)
        ok = b < max_blocks
        tl.store(block_expert_ptr + b, tl.where(has, expert, -1), mask=ok)
        tl.store(block_rows_ptr + b, tl.where(has, tl.minimum(rows, BM), 0), mask=ok)

    # N and max_blocks vary with the batch: not specialised, so one compile serves every batch.
    @triton.jit(do_not_specialize=["N", "max_blocks"])
    def _align_one_kernel(ids_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, N, max_blocks,
                          E_PAD: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr, BLK: tl.constexpr):
        e = tl.arange(0, E_PAD)
        counts = tl.zeros([E_PAD], dtype=tl.int32)
        for s in range(0, N, CHUNK):
            i = s + tl.arange(0, CHUNK)
            v = tl.load(ids_ptr + i, mask=i < N, other=E_PAD).to(tl.int32)  # E_PAD: no bin
            counts += tl.sum((v[:, None] == e[None, :]).to(tl.int32), axis=0)
        first, last = _blocks_of(counts, e, BM)
        for b0 in range(0, max_blocks, BLK):
            _write_blocks(block_expert_ptr, block_rows_ptr, b0 + tl.arange(0, BLK), counts, first, last, e,
                          max_blocks, BM)
        seen = tl.zeros([E_PAD], dtype=tl.int32)
        for s in range(0, N, CHUNK):
            i = s + tl.arange(0, CHUNK)
            ok = i < N
            v = tl.load(ids_ptr + i, mask=ok, other=-1).to(tl.int32)
            hit = v[:, None] == e[None, :]
            before = tl.cumsum(hit.to(tl.int32), axis=0) - 1 + seen[None, :]   # rank within expert
            row = tl.sum(tl.where(hit, before + first[None, :] * BM, 0), axis=1)
            tl.store(sorted_ptr + row, i, mask=ok & (v >= 0))   # -1: no expert here, no row
            seen += tl.sum(hit.to(tl.int32), axis=0)

    @triton.jit(do_not_specialize=["N"])
    def _chunk_hist_kernel(ids_ptr, hist_ptr, N, E_PAD: tl.constexpr, CH: tl.constexpr):
        c = tl.program_id(0)
        e = tl.arange(0, E_PAD)
        i = c * CH + tl.arange(0, CH)
        v = tl.load(ids_ptr + i, mask=i < N, other=E_PAD).to(tl.int32)
        tl.store(hist_ptr + c * E_PAD + e, tl.sum((v[:, None] == e[None, :]).to(tl.int32), axis=0))

    @triton.jit(do_not_specialize=["N", "max_blocks", "C"])
    def _chunk_place_kernel(ids_ptr, hist_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, N, max_blocks, C,
                            E_PAD: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr, RB: tl.constexpr,
                            BLK: tl.constexpr):
        c = tl.program_id(0)
        e = tl.arange(0, E_PAD)
        counts = tl.zeros([E_PAD], dtype=tl.int32)
        before = tl.zeros([E_PAD], dtype=tl.int32)      # pairs of each expert in the chunks before c
        for r0 in range(0, C, RB):
            r = r0 + tl.arange(0, RB)
            h = tl.load(hist_ptr + r[:, None] * E_PAD + e[None, :], mask=(r < C)[:, None], other=0)
            counts += tl.sum(h, axis=0)
            before += tl.sum(tl.where((r < c)[:, None], h, 0), axis=0)
        first, last = _blocks_of(counts, e, BM)
        for b0 in range(c * BLK, max_blocks, C * BLK):   # this chunk's stride of the block table
            _write_blocks(block_expert_ptr, block_rows_ptr, b0 + tl.arange(0, BLK), counts, first, last, e,
                          max_blocks, BM)
        i = c * CH + tl.arange(0, CH)
        ok = i < N
        v = tl.load(ids_ptr + i, mask=ok, other=-1).to(tl.int32)
        hit = v[:, None] == e[None, :]
        rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1 + before[None, :]
        row = tl.sum(tl.where(hit, rank + first[None, :] * BM, 0), axis=1)
        tl.store(sorted_ptr + row, i, mask=ok & (v >= 0))


def align(ids: torch.Tensor, num_experts: int, block_m: int, chunked: bool | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pairs [max_blocks * block_m] int32, block expert [max_blocks] int32 (-1: unused
    block), block valid rows [max_blocks] int32) for ids [T, k], as the module docstring says.
    `chunked` forces an implementation (tests, benchmarks); None picks by the pair count."""
    N = ids.numel()
    flat = ids.reshape(-1)
    max_blocks = triton.cdiv(N, block_m) + min(num_experts, N)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    block_rows = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    e_pad = max(_next_pow2(num_experts), 16)
    if chunked is None:
        chunked = N > ONE_PROGRAM_MAX_PAIRS
    if not chunked:
        chunk = max(16, min(1024, 16384 // e_pad))
        _align_one_kernel[(1,)](flat, sorted_pairs, block_expert, block_rows, N, max_blocks, E_PAD=e_pad,
                                BM=block_m, CHUNK=chunk, BLK=max(16, min(64, 8192 // e_pad)), num_warps=4)
        return sorted_pairs, block_expert, block_rows
    ch = max(16, min(128, 16384 // e_pad))     # a [CH, E_PAD] compare tile per program
    C = triton.cdiv(N, ch)
    hist = torch.empty(C, e_pad, dtype=torch.int32, device=ids.device)
    _chunk_hist_kernel[(C,)](flat, hist, N, E_PAD=e_pad, CH=ch, num_warps=4)
    _chunk_place_kernel[(C,)](flat, hist, sorted_pairs, block_expert, block_rows, N, max_blocks, C, E_PAD=e_pad,
                              BM=block_m, CH=ch, RB=max(16, min(64, 8192 // e_pad)), BLK=max(16, min(64, 8192 // e_pad)),
                              num_warps=8)
    return sorted_pairs, block_expert, block_rows
