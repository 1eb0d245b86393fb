"""Attention over a paged KV cache, behind a backend interface.

A step's tokens are flattened (varlen): request i owns query rows
`query_start[i] : query_start[i+1]`. Each query row knows its *cache index* (the slot index
within its request's sequence where its own K/V were written), which defines causality; a
request may instead carry a custom boolean mask over its context (tree attention). Both
the target model and the EAGLE-3 head go through this interface.

Contract of a backend: `write(k_cache, v_cache, k, v, meta)` stores new K/V at
`meta.slot_mapping` (slot -1 = don't store: the position's K/V already live in a shared
prefix-cache block); `forward(q, k_cache, v_cache, meta, scale, window)` returns [T, Hq, D].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything attention needs for one forward. Built by the runner, read-only after."""

    slot_mapping: torch.Tensor          # [T] int64, -1 = skip write
    query_start: list[int]              # [B+1] row offsets of each request
    context_lens: list[int]             # [B] cache entries visible to the request (incl. new)
    kv_start: list[int]                 # [B] first visible cache index (the draft skips slot 0)
    cache_index: torch.Tensor           # [T] int64: each query row's own index in its sequence
    block_tables: torch.Tensor          # [B, max_blocks] int64 (padded with 0)
    custom_masks: list[torch.Tensor | None]  # [B] None or bool [q_len, context_len]
    positions: torch.Tensor | None = None    # [T] rotary positions (may differ from cache_index)

    @property
    def num_reqs(self) -> int:
        return len(self.context_lens)


class TorchAttentionBackend:
    """Reference backend in plain PyTorch (CPU and GPU): gather each request's pages into a
    padded [B, S] context and run scaled-dot-product attention with an explicit mask."""

    name = "torch"

    @staticmethod
    def write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              meta: AttentionMetadata) -> None:
        # k_cache: [num_blocks * block_size, Hkv, D] (flat slots)
        slots = meta.slot_mapping
        keep = slots >= 0
        if bool(keep.all()):
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        elif bool(keep.any()):
            idx = keep.nonzero().squeeze(1)
            k_cache.index_copy_(0, slots[idx], k[idx].to(k_cache.dtype))
            v_cache.index_copy_(0, slots[idx], v[idx].to(v_cache.dtype))

    @staticmethod
    def forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, block_size: int,
                window: int | None = None) -> torch.Tensor:
        T, Hq, D = q.shape
        Hkv = k_cache.shape[1]
        B = meta.num_reqs
        dev = q.device
        S = max(meta.context_lens)
        nb = (S + block_size - 1) // block_size
        # Gather pages: slot = block * block_size + offset.
        tables = meta.block_tables[:, :nb]
        slots = (tables.unsqueeze(-1) * block_size + torch.arange(block_size, device=dev)).reshape(B, -1)[:, :S]
        k = k_cache[slots]  # [B, S, Hkv, D]
        v = v_cache[slots]
        q_lens = [meta.query_start[i + 1] - meta.query_start[i] for i in range(B)]
        Q = max(q_lens)
        # Pad queries into [B, Q].
        row_b = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(q_lens, device=dev))
        starts = torch.tensor(meta.query_start[:-1], device=dev)
        row_q = torch.arange(T, device=dev) - starts[row_b]
        qp = q.new_zeros(B, Q, Hq, D)
        qp[row_b, row_q] = q
        # Mask [B, Q, S]: causal by cache index, within [kv_start, context_len), optional window.
        ci = torch.zeros(B, Q, dtype=torch.long, device=dev)
        ci[row_b, row_q] = meta.cache_index
        j = torch.arange(S, device=dev).view(1, 1, S)
        ctx = torch.tensor(meta.context_lens, device=dev).view(B, 1, 1)
        kvs = torch.tensor(meta.kv_start, device=dev).view(B, 1, 1)
        mask = (j <= ci.unsqueeze(-1)) & (j < ctx) & (j >= kvs)
        for b, cm in enumerate(meta.custom_masks):
            if cm is not None:
                mask[b, : cm.shape[0], : cm.shape[1]] = cm
                mask[b, : cm.shape[0], cm.shape[1]:] = False
        if window is not None:
            # Sliding window by rotary position (a tree node's position is below its cache
            # index; its ancestors are never further than the tree's depth away).
            qpos = torch.zeros(B, Q, dtype=torch.long, device=dev)
            qpos[row_b, row_q] = meta.positions if meta.positions is not None else meta.cache_index
            mask &= j > qpos.unsqueeze(-1) - window
        valid_row = torch.zeros(B, Q, dtype=torch.bool, device=dev)
        valid_row[row_b, row_q] = True
        mask &= valid_row.unsqueeze(-1)
        mask[..., 0] |= ~mask.any(-1)  # padding rows: attend somewhere to avoid NaN
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
            attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=(Hq != Hkv))
        return out.transpose(1, 2)[row_b, row_q]  # [T, Hq, D]


ATTENTION_BACKENDS = {"torch": TorchAttentionBackend}


def get_backend(name: str = "torch"):
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}") from None
