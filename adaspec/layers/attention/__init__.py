"""Paged attention.

meta.py: the metadata contract (`AttnMeta`, `launch_plan`); torch_ref.py: the vectorized
PyTorch reference backend (CPU path, test oracle); triton_kernels.py: the GPU kernels (import
it explicitly: it needs triton). The list-based backend the runner still uses lives in
attention_old.py until the runner moves to AttnMeta; it is re-exported here meanwhile.
"""
from adaspec.layers.attention.meta import AttnMeta, launch_plan
from adaspec.layers.attention.torch_ref import torch_paged_attention, torch_store_kv
from adaspec.layers.attention_old import (ATTENTION_BACKENDS, AttentionMetadata, TorchAttentionBackend,
                                          get_backend)

__all__ = ["AttnMeta", "launch_plan", "torch_paged_attention", "torch_store_kv", "ATTENTION_BACKENDS",
           "AttentionMetadata", "TorchAttentionBackend", "get_backend"]
