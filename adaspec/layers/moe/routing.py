"""Routers: router logits -> (top-k weights, top-k expert ids), one pure function per kind.

A router kind is looked up in `ROUTERS` by `RouterConfig.kind`; adding one is adding an entry,
not a branch. Every function takes fp32 logits [T, E] (the model computes them in the dtype its
architecture uses, see models/moe.py) and returns fp32 weights [T, k] and int64 ids [T, k]. The
order of the k ids is topk's order; the expert sums never depend on it beyond fp rounding.

Kinds (what Hugging Face computes for each architecture):
  softmax        p = softmax(logits); top-k of p; optional renormalisation w / sum(w)
                 (Qwen2-MoE, Qwen3-MoE: `norm_topk_prob`; Mixtral: always).
  sigmoid_group  s = sigmoid(logits); choice = s + e_score_correction_bias; keep the
                 `topk_group` best of `n_group` groups (a group scores the sum of its two best
                 choices); top-k of choice among them; w = s at those ids (the bias only
                 selects); optional renormalisation w / (sum(w) + 1e-20); w *= scaling
                 (GLM-4.5 / DeepSeek-V3 "noaux_tc").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from adaspec.layers.fused_ops import use_triton


@dataclass(frozen=True)
class RouterConfig:
    kind: str                 # a key of ROUTERS
    num_experts: int
    top_k: int
    renormalize: bool = False
    n_group: int = 1          # sigmoid_group: groups of num_experts // n_group experts
    topk_group: int = 1       # sigmoid_group: groups kept
    scaling: float = 1.0      # multiplies the final weights (routed_scaling_factor)

    def __post_init__(self):
        if self.kind not in ROUTERS:
            raise ValueError(f"unknown router kind {self.kind!r}; supported: {sorted(ROUTERS)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.kind == "sigmoid_group":
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            per_group = self.num_experts // self.n_group
            if self.n_group > 1 and per_group < 2:
                raise ValueError(f"group-limited routing needs >= 2 experts per group, got {per_group}")
            if self.top_k > self.topk_group * per_group:
                raise ValueError(f"top_k={self.top_k} exceeds the {self.topk_group} x {per_group} experts "
                                 f"the kept groups hold")


def softmax_topk(logits: torch.Tensor, cfg: RouterConfig, bias: torch.Tensor | None = None):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * cfg.scaling if cfg.scaling != 1.0 else weights, ids


def sigmoid_group_topk(logits: torch.Tensor, cfg: RouterConfig, bias: torch.Tensor | None = None):
    scores = logits.float().sigmoid()
    choice = scores + bias.float() if bias is not None else scores
    if cfg.n_group > 1:
        T = choice.shape[0]
        grouped = choice.view(T, cfg.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)            # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)
    ids = torch.topk(choice, cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.scaling, ids


ROUTERS: dict[str, Callable] = {"softmax": softmax_topk, "sigmoid_group": sigmoid_group_topk}


def _softmax_topk_fused(logits: torch.Tensor, cfg: RouterConfig, bias: torch.Tensor | None = None):
    from adaspec.layers.moe.triton_kernels import softmax_topk_triton

    weights, ids = softmax_topk_triton(logits, cfg.top_k, cfg.renormalize)
    return weights * cfg.scaling if cfg.scaling != 1.0 else weights, ids


#: One-launch versions where they exist (on CUDA: the torch versions are ~6 small kernels each,
#: which at batch 1 is most of a sparse layer's launch time, x48 layers).
FUSED_ROUTERS: dict[str, Callable] = {"softmax": _softmax_topk_fused}


def route(logits: torch.Tensor, cfg: RouterConfig, bias: torch.Tensor | None = None):
    """(weights fp32 [T, k], ids int64 [T, k]) for router logits [T, E] under `cfg`. On CUDA
    (or under ADASPEC_TRITON_INTERPRET=1) a kind with a fused kernel runs it."""
    if logits.dim() != 2 or logits.shape[1] != cfg.num_experts:
        raise ValueError(f"route: logits {tuple(logits.shape)} are not [T, {cfg.num_experts}]")
    fn = FUSED_ROUTERS.get(cfg.kind) if use_triton(logits) else None
    return (fn or ROUTERS[cfg.kind])(logits, cfg, bias)
