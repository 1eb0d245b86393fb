"""How many KV blocks an engine gets: the bytes of one block (target and draft KV of
`block_size` positions, this rank's heads) and the blocks that fit the memory budget."""
from __future__ import annotations

import torch

from adaspec.config import EngineConfig

CPU_DEFAULT_KV_BYTES = 128 * 2**20


def kv_bytes_per_block(dtype: torch.dtype, spec, draft, block_size: int) -> int:
    """Bytes of one block: K and V of every target layer (`spec`: this rank's heads) and of
    every draft layer (`draft`: the EAGLE-3 head, or None)."""
    el = torch.tensor([], dtype=dtype).element_size()
    per_tok = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * el
    if draft is not None:
        per_tok += 2 * draft.num_layers * draft.spec.num_kv_heads * draft.spec.head_dim * el
    return per_tok * block_size


def num_kv_blocks(cfg: EngineConfig, device: torch.device, bytes_per_block: int, max_position: int) -> int:
    """`cache.num_blocks` if set; else what `cache.memory_bytes` holds, or on CUDA the free
    memory times `gpu_memory_utilization` less 4 GiB (activations, graphs); at most what
    `max_num_seqs` requests of the model's full length could use."""
    c = cfg.cache
    if c.num_blocks is not None:
        return c.num_blocks
    budget = c.memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * c.gpu_memory_utilization) - 4 * 2**30
        else:
            budget = CPU_DEFAULT_KV_BYTES
    useful = cfg.scheduler.max_num_seqs * (max_position // cfg.cache.block_size + 2)
    return max(1, min(budget // bytes_per_block, useful))
