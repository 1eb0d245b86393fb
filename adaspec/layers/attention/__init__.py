"""Paged attention behind one small interface, plus the forward context layers read it from.

    backend = get_backend("triton" | "torch")
    with forward_context(ForwardContext(meta, backend, kv_caches)):
        hidden = model(input_ids, positions)      # layers call ctx.attend(layer_id, q)

`AttnMeta` (see meta.py) is built once per forward by the runner from one host->device copy;
layers never build tensors. Backends keep no per-forward state of their own, so a forward
captured in a CUDA graph replays correctly as long as the metadata tensors it read are
refilled in place: that is the capture/replay contract (the runner's step buffers are static).
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass

import torch

from adaspec.layers.attention.meta import AttnMeta, launch_plan
from adaspec.layers.attention.torch_ref import torch_paged_attention, torch_store_kv


class AttentionBackend(abc.ABC):
    """forward(q [T, Hq, D], k_cache, v_cache [slots, Hkv, D], meta, scale, window) -> [T, Hq, D]."""

    name = "base"
    graphable = False   # safe inside a CUDA graph (no host sync, no data-dependent launch)

    @abc.abstractmethod
    def forward(self, q, k_cache, v_cache, meta: AttnMeta, scale: float, window: int | None) -> torch.Tensor:
        """Attention of q over the paged cache under `meta`'s visibility rules."""

    def block_q(self, max_q_len: int, group: int, num_reqs: int | None = None) -> int:
        """Query rows per program of the launch plan (only the Triton backend uses it)."""
        return 1

    def warm_up(self, num_heads: int, kv_cache: tuple, block_table, block_size: int, dtype, windows) -> int:
        """Compile what a forward of this layout can launch, before serving (JIT backends);
        returns the number of launches."""
        return 0

    def graph_splits(self, rows: int, block_q: int, group: int, num_kv_heads: int, max_ctx_len: int,
                     device) -> int | None:
        """The split-KV factor a token graph of `rows` rows fixes (None: the backend has none)."""
        return None


class TorchBackend(AttentionBackend):
    """CPU reference (also runs on CUDA): gathers pages and calls SDPA with an explicit mask."""

    name = "torch"

    def forward(self, q, k_cache, v_cache, meta, scale, window):
        return torch_paged_attention(q, k_cache, v_cache, meta, scale, window)


class TritonBackend(AttentionBackend):
    """One Triton kernel for decode, chunked prefill and (tree) verification; graph-safe."""

    name = "triton"
    graphable = True

    def forward(self, q, k_cache, v_cache, meta, scale, window):
        from adaspec.layers.attention.triton_kernels import triton_paged_attention
        return triton_paged_attention(q, k_cache, v_cache, meta, scale, window)

    def block_q(self, max_q_len: int, group: int, num_reqs: int | None = None) -> int:
        from adaspec.layers.attention.triton_kernels import choose_block_q
        return choose_block_q(max_q_len, group, num_reqs)

    def graph_splits(self, rows, block_q, group, num_kv_heads, max_ctx_len, device) -> int | None:
        from adaspec.layers.attention.triton_kernels import token_graph_splits
        return token_graph_splits(rows, block_q, group, num_kv_heads, max_ctx_len, device)

    def warm_up(self, num_heads, kv_cache, block_table, block_size, dtype, windows) -> int:
        from adaspec.layers.attention.triton_kernels import warm_up
        return warm_up(num_heads, kv_cache[0], kv_cache[1], block_table, block_size, dtype, windows)


ATTENTION_BACKENDS = {"torch": TorchBackend, "triton": TritonBackend}


def get_backend(name: str) -> AttentionBackend:
    try:
        return ATTENTION_BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}") from None


@dataclass
class ForwardContext:
    """What attention layers need besides their own weights, for one forward."""

    meta: AttnMeta
    backend: AttentionBackend
    kv_caches: list  # per layer: (k_cache, v_cache)


_CONTEXT: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a forward_context")
    return _CONTEXT


__all__ = ["AttnMeta", "launch_plan", "AttentionBackend", "TorchBackend", "TritonBackend", "get_backend",
           "ForwardContext", "forward_context", "get_forward_context", "torch_store_kv"]
