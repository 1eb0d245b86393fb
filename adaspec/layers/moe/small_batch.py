"""The fused-MoE small path (few (token, slot) pairs: decode): two launches, no alignment.

    gate_up   grid (pair, I tile): the pair's expert read straight from the top-k ids; one row,
              so a GEMV (an fp32 [BN, BK] accumulator reduced over K once, after the loop)
              instead of a 16-row tensor-core tile of which 15 rows would be padding.
              An id of -1 (the expert is on another rank) skips the pair in both kernels.
    down+sum  grid (token, H tile): the token's k slots at once, a [KP, BN, BK] tile of k
              experts' w2 rows (KP: k padded to a power of two); the top-k sum happens in the
              program, so the separate reduce kernel of the aligned path is gone.

Rounding: the aligned path's steps exactly (see triton_kernels' docstring): gate and up
round, silu rounds, the product rounds; per slot the down product rounds, times the weight
rounds; the k rounded terms are summed in fp32 and rounded once (what torch's sum of the
aligned path's out_k does). Only the order of fp32 sums differs.

Both loops use tl.range(num_stages=NS): a loop without tl.dot gets its loads software-
pipelined only when the loop itself names a stage count. No kernel argument depends on the
token count (it is the grid only), so one compile serves every batch the path takes.
"""
from __future__ import annotations

import torch

from adaspec.layers.fused_ops import _next_pow2, triton
from adaspec.layers import pdl

if triton is not None:
    import triton.language as tl

    from adaspec.layers.pdl import gdc_enter

    @triton.jit
    def _gate_up_pairs_kernel(x_ptr, w_ptr, out_ptr, ids_ptr, H, I, stride_x, stride_we, stride_wn, stride_o,
                              TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr,
                              USE_GDC: tl.constexpr = False):
        gdc_enter(USE_GDC)   # programmatic dependent launch (layers/pdl.py)
        pair = tl.program_id(0).to(tl.int64)
        e = tl.load(ids_ptr + pair).to(tl.int64)
        if e < 0:   # the expert is on another rank: the down kernel skips this slot
            return
        tok = pair // TOPK
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = n < I
        w_base = w_ptr + e * stride_we
        gate_rows = w_base + n[:, None].to(tl.int64) * stride_wn           # [BN, 1]
        up_rows = w_base + (n[:, None] + I).to(tl.int64) * stride_wn
        acc_g = tl.zeros([BN, BK], dtype=tl.float32)   # reduced over K once, after the loop
        acc_u = tl.zeros([BN, BK], dtype=tl.float32)
        for k0 in tl.range(0, H, BK, num_stages=NS):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < H
            a = tl.load(x_ptr + tok * stride_x + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            m = n_ok[:, None] & k_ok[None, :]
            acc_g += tl.load(gate_rows + kk[None, :], mask=m, other=0.0).to(tl.float32) * a
            acc_u += tl.load(up_rows + kk[None, :], mask=m, other=0.0).to(tl.float32) * a
        ty = out_ptr.dtype.element_ty
        # HF: gate and up round to the dtype, silu rounds, then the product does.
        g = tl.sum(acc_g, axis=1).to(ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32) * tl.sum(acc_u, axis=1).to(ty).to(tl.float32)
        tl.store(out_ptr + pair * stride_o + n, act.to(ty), mask=n_ok)

    @triton.jit
    def _down_sum_kernel(a_ptr, w_ptr, out_ptr, topw_ptr, ids_ptr, H, I, stride_a, stride_we, stride_wn, stride_o,
                         TOPK: tl.constexpr, KP: tl.constexpr, ROUND_W: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr, USE_GDC: tl.constexpr = False):
        gdc_enter(USE_GDC)   # programmatic dependent launch (layers/pdl.py)
        tok = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KP)                  # the token's slots (KP: TOPK padded to a power of 2)
        pair = tok * TOPK + j
        e = tl.load(ids_ptr + pair, mask=j < TOPK, other=-1).to(tl.int64)
        j_ok = e >= 0                         # a real slot whose expert is here
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = n < H
        w_rows = w_ptr + e[:, None, None] * stride_we + n[None, :, None].to(tl.int64) * stride_wn   # [KP, BN, 1]
        w_ok = j_ok[:, None, None] & n_ok[None, :, None]
        a_rows = a_ptr + pair[:, None] * stride_a                                                    # [KP, 1]
        acc = tl.zeros([KP, BN, BK], dtype=tl.float32)
        for k0 in tl.range(0, I, BK, num_stages=NS):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < I
            a = tl.load(a_rows + kk[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_rows + kk[None, None, :], mask=w_ok & k_ok[None, None, :], other=0.0).to(tl.float32)
            acc += w * a[:, None, :]
        ty = out_ptr.dtype.element_ty
        weight = tl.load(topw_ptr + pair, mask=j_ok, other=0.0)
        if ROUND_W:   # the router's weight rounded to the model dtype first (Qwen)
            weight = weight.to(ty)
        weight = weight.to(tl.float32)
        # Per slot as the aligned path's down kernel: the expert output rounds, then * weight rounds;
        # then the reduce kernel's step: the k rounded terms summed in fp32, rounded once. Padded
        # slots and slots of other ranks' experts add an exact 0 (weight 0, rows not loaded).
        y = (tl.sum(acc, axis=2).to(ty).to(tl.float32) * weight[:, None]).to(ty).to(tl.float32)
        tl.store(out_ptr + tok * stride_o + n, tl.sum(y, axis=0).to(ty), mask=n_ok)


def experts_small(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  inter: torch.Tensor, cfg: dict, round_weights: bool) -> torch.Tensor:
    """out [T, H] for x [T, H] and the flat, contiguous top-k `weights` and `ids` [T*k]; `inter`
    [T*k, I] is the scratch for silu(gate) * up. `cfg`: BLOCK_N/BLOCK_K (gate/up), DOWN_BLOCK_N/
    DOWN_BLOCK_K (down), num_warps, num_stages (see triton_kernels.fit_small)."""
    T, H = x.shape
    N, I = inter.shape
    k = N // T
    ns, nw = cfg.get("num_stages", 3), cfg.get("num_warps", 4)
    _gate_up_pairs_kernel[(N, triton.cdiv(I, cfg["BLOCK_N"]))](
        x, w13, inter, ids, H, I, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        TOPK=k, BN=cfg["BLOCK_N"], BK=cfg["BLOCK_K"], NS=ns, num_warps=nw, num_stages=ns, **pdl.launch_kw(x))
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    _down_sum_kernel[(T, triton.cdiv(H, cfg["DOWN_BLOCK_N"]))](
        inter, w2, out, weights, ids, H, I, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOPK=k, KP=_next_pow2(k), ROUND_W=round_weights, BN=cfg["DOWN_BLOCK_N"], BK=cfg["DOWN_BLOCK_K"],
        NS=ns, num_warps=nw, num_stages=ns, **pdl.launch_kw(x))
    return out
