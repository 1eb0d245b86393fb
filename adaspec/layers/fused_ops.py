"""Fused elementwise ops of the decoder (placeholder torch references; the Triton versions
land with the kernels branch)."""
from __future__ import annotations

import torch

from adaspec.layers.rotary import apply_rotary


def rms_norm(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(dtype), x


def silu_and_mul(x):
    i = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :i]) * x[..., i:]


def rotary_qkv_store(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot_mapping):
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    half = cos_sin.shape[1] // 2
    cs = cos_sin[positions]
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1).to(qkv.dtype)
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1).to(qkv.dtype)
    q = apply_rotary(q.reshape(T, num_heads, head_dim), cos, sin)
    k = apply_rotary(k.reshape(T, num_kv_heads, head_dim), cos, sin)
    v = v.reshape(T, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    idx = keep.nonzero().squeeze(1)
    k_cache.index_copy_(0, slot_mapping[idx], k[idx].to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping[idx], v[idx].to(v_cache.dtype))
    return q
