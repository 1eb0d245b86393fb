"""The fused-MoE kernels' rounding contract (adaspec/layers/moe/triton_kernels.py's docstring)
written out in torch, one (token, slot) pair at a time: the oracle of the kernels in reduced
precision. Every rounding to the model dtype goes through `round_to`; the dot products are
fp64 rounded to fp32, so a kernel that keeps the contract equals it bit for bit but where its
own fp32 sum order moves a value across a rounding boundary."""
from __future__ import annotations

import torch


def round_nearest(dtype: torch.dtype):
    """fp32 -> dtype (round to nearest even, as CUDA and torch do) -> fp32."""
    return lambda t: t.float().to(dtype).float()


def round_toward_zero_bf16(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits -> fp32: what Triton's interpreter does."""
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def triton_bf16_rounding(device="cpu"):
    """The fp32 -> bf16 rounding that Triton applies here (its interpreter rounds toward zero,
    the GPU to nearest even): probed with a one-element kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr):
        tl.store(y_ptr, tl.load(x_ptr).to(tl.bfloat16))

    x = torch.tensor([1.0 + 0.75 * 2 ** -7], device=device)   # 3/4 of a bf16 ulp above 1
    y = torch.empty(1, dtype=torch.bfloat16, device=device)
    cast[(1,)](x, y)
    return round_nearest(torch.bfloat16) if float(y) != 1.0 else round_toward_zero_bf16


def contract_ref(x, w13, w2, weights, ids, round_to, round_weights: bool = False) -> torch.Tensor:
    """fp32 [T, H] holding model-dtype values: per pair, gate and up round, silu rounds, the
    product rounds; the down product rounds, times the weight (rounded first if
    `round_weights`) rounds; the k rounded terms are summed (fp64, then fp32) and round once."""
    T, k = ids.shape
    I = w2.shape[2]
    out = torch.empty(T, x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(T):
        total = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        for j in range(k):
            e = int(ids[t, j])
            gu = (w13[e].double() @ x[t].double()).float()
            g, u = round_to(gu[:I]), round_to(gu[I:])
            act = round_to(round_to(g / (1.0 + torch.exp(-g))) * u)
            y = round_to((w2[e].double() @ act.double()).float())
            w = round_to(weights[t, j].float()) if round_weights else weights[t, j].float()
            total += round_to(y * w).double()
        out[t] = round_to(total.float())
    return out
