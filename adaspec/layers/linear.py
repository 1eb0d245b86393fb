"""Linear layers of few rows: a Triton GEMV where cuBLAS leaves bandwidth unused.

At one row (decode at batch 1) a linear layer is a read of its weight. On the H200 cuBLAS's kernels for the Qwen3-30B-A3B attention projections read at
1.9-2.7 TB/s of the 4.3 the copy probe measures (session 4 call 5's profile: 7.7 us for the
21 MB qkv projection, 8.8 us with its split-K reduce for the 17 MB o_proj, ~5 us for the 0.5 MB
router), and they are ~1 ms of a 3.6 ms decode step there.

    gemv   grid (row m, tile of BN outputs): W[BN, K] streamed in BK chunks into an fp32
           [BN, BK] accumulator, reduced over K once after the loop; + bias; rounded once to
           the dtype (as cuBLAS does: fp32 accumulation, one rounding). The rows of one tile run
           next to each other, so W is read from HBM once and from L2 for the other rows.

`SmallLinear` is an nn.Linear that takes this path for half-precision CUDA inputs where
`gemv_applies` says (one row; up to MAX_ROWS for a router-sized output) when no gradient is wanted (and under the Triton interpreter when
ADASPEC_TRITON_INTERPRET=1); anything else is F.linear. The result differs from F.linear only in the order of the fp32 sums.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.layers.fused_ops import triton, use_triton
from adaspec.layers import pdl

# Measured on the H200 (benchmarks/kernels/gemv_sweep.py, session 6 call 3), default launch against
# cuBLAS, one row: 5.1 / 6.4 us (Qwen3-30B-A3B qkv), 4.3 / 7.3 (its o_proj), 2.4 / 4.9 (its router),
# 11.5 / 13.7 and 6.5 / 9.2 (Llama-3.1-8B qkv, o), 56.1 / 56.2 and 29.1 / 31.0 (its MLP). Each row
# of a program re-reads its weight tile, so at 2 and 4 rows it loses to cuBLAS (12.6 / 6.1 us for
# the MoE qkv at 4) except on a router's 128 outputs (2.4 / 4.9 at 4 rows).
MAX_ROWS, SMALL_N = 4, 1024
LAUNCH = (8, 512, 4, 3)   # BN, BK, num_warps, num_stages

if triton is not None:
    import triton.language as tl

    from adaspec.layers.pdl import gdc_enter

    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                     HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr,
                     USE_GDC: tl.constexpr = False):
        gdc_enter(USE_GDC)   # programmatic dependent launch (layers/pdl.py)
        m = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = n < N
        rows = w_ptr + n[:, None].to(tl.int64) * stride_w
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=NS):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < K
            a = tl.load(x_ptr + m * stride_x + kk, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * a[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes x [M, K]: one row, or up to MAX_ROWS for at most SMALL_N outputs (the
    router); half precision; a Triton device."""
    rows = MAX_ROWS if weight.shape[0] <= SMALL_N else 1
    return (x.dim() == 2 and 0 < x.shape[0] <= rows and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and use_triton(x) and weight.stride(-1) == 1 and x.stride(-1) == 1
            and not (torch.is_grad_enabled() and weight.requires_grad))   # no backward: inference only


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         launch: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] in x's dtype, one kernel (see the module
    docstring); the caller checked `gemv_applies`. `launch`: (BN, BK, num_warps, num_stages),
    default `LAUNCH` (benchmarks/kernels/gemv_sweep.py times the candidates)."""
    M, K = x.shape
    N = weight.shape[0]
    bn, bk, warps, stages = launch or LAUNCH
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(M, triton.cdiv(N, bn))](
        x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BN=bn, BK=bk, NS=stages, num_warps=warps, num_stages=stages,
        **pdl.launch_kw(x))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `gemv` where it applies."""
    if gemv_applies(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class SmallLinear(nn.Linear):
    """nn.Linear whose forward of few half-precision rows is `gemv` (same parameters, same
    state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
