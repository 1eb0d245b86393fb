"""Reference experts: a loop over the experts a batch touches, tokens sorted by expert.

The CPU path and the oracle of the Triton kernel's conformance tests. It computes what
Hugging Face's expert loop computes, in the same order (experts ascending, each token's
contribution rounded to the model dtype before it is added), so fp32 outputs match HF's.
It reads the per-expert token counts on the host: not for CUDA graphs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adaspec.layers.fused_ops import silu_and_mul_ref


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, j].

    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; weights [T, k] (any float
    dtype; the product is taken in the promoted dtype, then rounded to x.dtype); ids [T, k]
    with values in [0, E), or -1 for a slot whose expert is not here (expert parallelism): such a
    slot adds nothing. Returns a new [T, H] tensor of x.dtype."""
    T, k = ids.shape
    E = w13.shape[0]
    out = torch.zeros_like(x)
    if T == 0:
        return out
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)          # flat slots t * k + j, grouped by expert
    skipped = int((flat < 0).sum())                   # -1 sorts first: those slots are passed over
    order = order[skipped:]
    counts = torch.bincount(flat[flat >= 0], minlength=E).tolist()
    w_flat = weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        tok = slots // k
        y = F.linear(silu_and_mul_ref(F.linear(x[tok], w13[e])), w2[e])
        out.index_add_(0, tok, (y * w_flat[slots, None]).to(out.dtype))
    return out
