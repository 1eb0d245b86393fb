"""Llama-family decoder (Llama incl. Llama-3 rope scaling, Qwen2 qkv bias, Qwen3 q/k norm,
Mistral sliding window) over a paged KV cache.

`forward(input_ids, meta, kv_caches, capture)` takes a flat varlen batch and returns the final
normed hidden states plus, when `capture` lists layer indices, the *inputs* of those layers
(pre-norm residual stream) concatenated — the features an EAGLE-3 head consumes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.layers.attention import AttentionMetadata
from adaspec.layers.rotary import RotaryEmbedding, apply_rotary


@dataclass(frozen=True)
class ModelArch:
    """What varies between the supported architectures."""

    qkv_bias: bool = False
    qk_norm: bool = False


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Multi-head attention with GQA. `in_dim` differs from hidden for the EAGLE-3 layer (2H)."""

    def __init__(self, spec: ModelSpec, window: int | None, in_dim: int | None = None):
        super().__init__()
        self.nh, self.nkv, self.hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        in_dim = in_dim or spec.hidden_size
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, spec.hidden_size, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.window = window
        self.scale = self.hd ** -0.5

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated) and V for x — all that's needed to fill the cache."""
        T = x.shape[0]
        k = self.k_proj(x).view(T, self.nkv, self.hd)
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rotary(k, cos, sin), self.v_proj(x).view(T, self.nkv, self.hd)

    def forward(self, x, cos, sin, meta: AttentionMetadata, cache: tuple, backend, block_size: int):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.nh, self.hd)
        if self.qk_norm:
            q = self.q_norm(q)
        q = apply_rotary(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        backend.write(cache[0], cache[1], k, v, meta)
        o = backend.forward(q, cache[0], cache[1], meta, self.scale, block_size, self.window)
        return self.o_proj(o.reshape(T, self.nh * self.hd))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(spec, spec.sliding_windows[layer_idx])
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, h, cos, sin, meta, cache, backend, block_size):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, cache, backend, block_size)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """One class for the Llama family; differences live in `ModelSpec` flags."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_parameters, spec.max_position)

    # Checkpoint names are "model.layers.0..." for the body and "lm_head.weight".
    def checkpoint_name(self, param_name: str) -> str:
        return param_name if param_name.startswith("lm_head") else "model." + param_name

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list, backend,
                block_size: int, capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(meta.positions, h.dtype)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = h
            h = layer(h, cos, sin, meta, kv_caches[i], backend, block_size)
        captured[len(self.layers)] = h
        aux = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return self.norm(h), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
