"""Kernel warm-up at start-up (`ModelRunner.setup` on CUDA, every rank): the attention
variants eager steps can launch, a model's own launch buckets (fused MoE) and the in-flight
shift and chain-step kernels compile before serving, not at their first use in the middle of it.
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("adaspec")


def warm_up_kernels(runner) -> None:
    """Compile the attention variants eager steps (prefill, mixed batches) can launch, and
    the shift kernels, now rather than at their first use while serving. A failure here
    costs only those stalls."""
    t0 = time.perf_counter()
    heads = [(runner.local_spec.num_heads, runner.kv_caches[0], runner.dtype, set(runner.model_spec.sliding_windows))]
    if runner.draft is not None:
        heads.append((runner.draft.spec.num_heads, runner.draft_cache[0], runner.dtype, {None}))
    n = 0
    try:
        for num_heads, cache, dtype, windows in heads:
            n += runner.backend.warm_up(num_heads, cache, runner.rows.block_table, runner.block_size, dtype, windows)
        if hasattr(runner.model, "warm_up_kernels"):   # e.g. the fused-MoE launch buckets
            n += runner.model.warm_up_kernels(runner.cfg.scheduler.max_num_batched_tokens)
        if runner.draft is not None:   # the in-flight shift of speculative steps
            from adaspec.device import shift_kernels
            n += shift_kernels.warm_up(runner.rows.last_count, runner.rows.block_table, runner.block_size)
            n += runner.chain.steps.warm_up(runner.stg, runner.rows.pad_row)   # chain steps' metadata
        torch.cuda.synchronize()
    except Exception as ex:  # an optimization: never a reason not to serve
        log.warning("kernel warm-up failed (%s); kernels compile at first use", ex)
        return
    if n:
        log.info("kernels warmed up: %d launches in %.1f s", n, time.perf_counter() - t0)
