"""Mixture-of-experts layer primitives: routing (routing.py) and the experts' computation.

    weights, ids = route(router_logits_fp32, RouterConfig(...), bias)
    y = fused_experts(x, w13, w2, weights, ids)      # [T, H]

Dispatch (as layers/fused_ops.py picks its kernels): the Triton fused-MoE kernel
(triton_kernels.py) when x is on CUDA, or under ADASPEC_TRITON_INTERPRET=1 (tests); otherwise
the per-expert PyTorch loop (torch_ref.py), which is also the kernel's oracle.
"""
from __future__ import annotations

import torch

from adaspec.layers.fused_ops import use_triton
from adaspec.layers.moe.routing import ROUTERS, RouterConfig, route
from adaspec.layers.moe.torch_ref import fused_experts_ref

__all__ = ["ROUTERS", "RouterConfig", "route", "fused_experts", "fused_experts_ref", "local_ids"]


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, round_weights: bool = False, first_expert: int | None = None,
                  routed_experts: int | None = None) -> torch.Tensor:
    """sum over the k chosen experts of weight * down(silu(gate(x)) * up(x)); x [T, H],
    w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k]. `round_weights`: the weights are first
    rounded to x.dtype (Qwen's routers hand them over in the model dtype); the kernel does it
    on load instead of a separate cast. See torch_ref.fused_experts_ref.

    Expert parallelism: w13 / w2 hold experts first_expert .. first_expert + E - 1 of the
    `routed_experts` the router chose among, the ids are the router's (global), and a slot whose
    expert is not here adds nothing: this rank's part of the sum, which an all-reduce completes."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)} do not fit [T, H], [E, 2I, H], "
                         f"[E, H, I], [T, k]")
    if (first_expert is None) != (routed_experts is None):
        raise ValueError("fused_experts: first_expert and routed_experts go together (expert parallelism)")
    if first_expert is not None:
        ids = local_ids(ids, first_expert, w13.shape[0])
    if use_triton(x):
        from adaspec.layers.moe.triton_kernels import fused_experts_triton
        return fused_experts_triton(x, w13, w2, weights, ids, round_weights=round_weights,
                                    routed_experts=routed_experts)
    return fused_experts_ref(x, w13, w2, weights.to(x.dtype) if round_weights else weights, ids)


def local_ids(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Global expert ids -> indices into experts first .. first + count - 1, -1 for the others.
    Elementwise, no host sync (CUDA graphs capture it)."""
    local = ids - first
    return torch.where((local >= 0) & (local < count), local, -1)
