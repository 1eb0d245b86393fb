"""Llama-family decoder (Llama incl. Llama-3 rope scaling and `attention_bias` / `mlp_bias`,
Qwen2 qkv bias, Qwen3 q/k norm, Mistral sliding window) over a paged KV cache.

`forward(input_ids, positions)` takes a flat varlen batch (everything else it needs, the
attention metadata and the KV caches, comes from the forward context) and returns the final
normed hidden states plus, when `self.capture` lists layer indices, the *inputs* of those
layers (pre-norm residual stream) concatenated in layer order, each layer once: the features
an EAGLE-3 head consumes (as vLLM / SGLang / EAGLE build them).

Inference runs fused: `fuse()` (called once after loading) merges q/k/v and gate/up into one
matrix each; RMSNorm carries the residual add, rotary is applied together with the KV store
(adaspec/layers/fused_ops.py). Unfused modules still work (the EAGLE-3 trainer uses them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.layers import fused_ops
from adaspec.layers.attention import get_forward_context
from adaspec.layers.linear import SmallLinear
from adaspec.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from adaspec.models.moe_spec import MoeSpec


@dataclass(frozen=True)
class ModelArch:
    """What varies between the supported architectures."""

    qkv_bias: bool = False
    qk_norm: bool = False
    o_bias_from_attention_bias: bool = False   # config `attention_bias` also puts a bias on o_proj
    reads_mlp_bias: bool = False               # config `mlp_bias` puts biases on the dense MLP
    fused_checkpoint: bool = False             # qkv_proj / gate_up_proj tensors (Phi-3), split at load


@dataclass(frozen=True)
class ModelSpec:
    """The parts of a Hugging Face config.json the engine needs, normalised."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_windows: tuple  # per layer: None or window size
    eos_token_ids: tuple
    torch_dtype: str | None
    hidden_act: str = "silu"
    moe: MoeSpec | None = None  # mixture-of-experts layers (models/moe.py); None: every MLP dense
    o_bias: bool = False        # o_proj has a bias (Llama / Qwen3 `attention_bias`)
    mlp_bias: bool = False      # gate/up/down have biases (Llama `mlp_bias`)
    fused_checkpoint: bool = False  # the checkpoint holds qkv_proj and gate_up_proj (loader.split_fused)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: RMSNorm(x). With it: (RMSNorm(x + residual), x + residual)."""
        out, res = fused_ops.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, res)


def merge_linears(parts: list[nn.Linear], cls: type[nn.Linear] = nn.Linear) -> nn.Linear:
    """One `cls` whose output is the concatenation of `parts`' outputs (weights moved, not copied twice)."""
    w = torch.cat([p.weight.data for p in parts], dim=0)
    bias = parts[0].bias is not None
    lin = cls(w.shape[1], w.shape[0], bias=bias, device=w.device, dtype=w.dtype)
    lin.weight.data = w
    if bias:
        lin.bias.data = torch.cat([p.bias.data for p in parts], dim=0)
    for p in parts:  # free the originals' storage now, not at the next GC
        p.weight.data = torch.empty(0, device=w.device, dtype=w.dtype)
    return lin


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = SmallLinear(inter, hidden, bias=bias)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        self.gate_up_proj = merge_linears([self.gate_proj, self.up_proj], SmallLinear)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x)))


class Attention(nn.Module):
    """Multi-head attention with GQA. `in_dim` differs from hidden for the EAGLE-3 layer (2H).
    `layer_id` picks this layer's cache from the forward context."""

    def __init__(self, spec: ModelSpec, window: int | None, in_dim: int | None = None, layer_id: int = 0):
        super().__init__()
        self.nh, self.nkv, self.hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        in_dim = in_dim or spec.hidden_size
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=spec.qkv_bias)
        # The projections of few rows (decode at batch 1) take a Triton GEMV (layers/linear.py).
        self.o_proj = SmallLinear(self.nh * self.hd, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.window = window
        self.scale = self.hd ** -0.5
        self.layer_id = layer_id
        self.qkv_proj: nn.Linear | None = None

    def fuse(self) -> None:
        self.qkv_proj = merge_linears([self.q_proj, self.k_proj, self.v_proj], SmallLinear)
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv_proj is not None:
            return self.qkv_proj(x)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def _rotary_store(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kc: torch.Tensor,
                      vc: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The projection, then (Qwen3: the per-head RMSNorm of q and k,) rotary and the KV
        store in one kernel; returns the rotated q."""
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
        return fused_ops.rotary_qkv_store(self._qkv(x), positions, cos_sin, self.nh, self.nkv, self.hd, kc, vc,
                                          slot_mapping, *norms)

    def store_kv(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, cache: tuple,
                 slot_mapping: torch.Tensor) -> None:
        """Rotate and store K/V for x at `slot_mapping` without attention (the EAGLE-3 draft
        refresh). Computes q too: cheap next to the step, and one code path."""
        self._rotary_store(x, positions, cos_sin, cache[0], cache[1], slot_mapping)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        kc, vc = ctx.kv_caches[self.layer_id]
        q = self._rotary_store(x, positions, cos_sin, kc, vc, ctx.meta.slot_mapping)
        o = ctx.backend.forward(q, kc, vc, ctx.meta, self.scale, self.window)
        return self.o_proj(o.reshape(x.shape[0], self.nh * self.hd))


class DecoderLayer(nn.Module):
    """Attention then an MLP; `mlp` (anything mapping [T, H] -> [T, H] with a `fuse()`) defaults
    to the dense gated MLP, MoE models pass their sparse block."""

    def __init__(self, spec: ModelSpec, layer_idx: int, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(spec, spec.sliding_windows[layer_idx], layer_id=layer_idx)
        self.mlp = mlp if mlp is not None else MLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # Tensor parallelism (adaspec/parallel): the sum over ranks of the partial outputs of
        # the row-parallel o_proj and of the MLP (down_proj, or the experts and shared expert
        # together: one all-reduce per block). None: one rank, nothing to add.
        self.tp_reduce = None

    def forward(self, x, residual, positions, cos_sin):
        """x = input_layernorm(h) with residual = h (the layer's input). Returns (mlp output,
        residual): the next layer's input is their sum, which its own norm fuses."""
        x = self.self_attn(x, positions, cos_sin)
        if self.tp_reduce is not None:
            x = self.tp_reduce(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        return (self.tp_reduce(x) if self.tp_reduce is not None else x), residual

    def full(self, h, positions, cos_sin) -> torch.Tensor:
        """The whole layer on its input h (unfused residual stream; EAGLE-3 later layers)."""
        out, residual = self(self.input_layernorm(h), h, positions, cos_sin)
        return out + residual


class LlamaForCausalLM(nn.Module):
    """One class for the Llama family; differences live in `ModelSpec` flags."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, self.make_mlp(spec, i)) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # partial_rotary_factor < 1 (GLM-4.5): rotary on the first rot_dim dims of each head only.
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_parameters, spec.max_position,
                                      partial=float(spec.rope_parameters.get("partial_rotary_factor", 1.0)))
        self._capture: tuple[int, ...] = ()
        self.cos_sin: torch.Tensor | None = None

    @property
    def capture(self) -> tuple[int, ...]:
        """Layers whose inputs the EAGLE-3 head reads (index num_layers: the final pre-norm
        hidden), ascending and each once: the aux features are concatenated in LAYER order,
        a repeated id captured once, as vLLM, SGLang and EAGLE read them. Set it with any
        iterable of ids; a head must size its fc input by the distinct ids."""
        return self._capture

    @capture.setter
    def capture(self, ids) -> None:
        self._capture = tuple(sorted(set(int(i) for i in ids)))

    def make_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP (MoE models override this)."""
        return MLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)

    # Checkpoint names are "model.layers.0..." for the body and "lm_head.weight".
    def checkpoint_name(self, param_name: str) -> str:
        return param_name if param_name.startswith("lm_head") else "model." + param_name

    def fuse(self) -> None:
        """Merge q/k/v and gate/up of every layer (after loading, before serving)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def prepare_rotary(self, max_positions: int, device: torch.device) -> None:
        self.cos_sin = self.rotary.cos_sin_cache(max_positions, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        cos_sin = self.cos_sin
        if cos_sin is None or cos_sin.device != input_ids.device:
            self.prepare_rotary(self.spec.max_position, input_ids.device)
            cos_sin = self.cos_sin
        h = self.embed_tokens(input_ids)
        residual = None
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, residual = layer.input_layernorm.forward(h, residual) if residual is not None else \
                (layer.input_layernorm(h), h)
            if i in self._capture:
                captured.append(residual)
            h, residual = layer(x, residual, positions, cos_sin)
        out, residual = self.norm(h, residual)
        if len(self.layers) in self._capture:
            captured.append(residual)
        return out, (torch.cat(captured, dim=-1) if captured else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
