"""`/server_info`: what the server runs with (configuration, sampling defaults in force) and
the engine's live statistics."""
from __future__ import annotations

# What a request that leaves these out gets when the model ships no generation_config.json.
BUILTIN_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}


def server_info(serving) -> dict:
    """/server_info: the configuration in force, the policy's state and the engine's live stats."""
    cfg = serving.aengine.config
    stats = dict(serving.aengine.stats)
    block_size = cfg.cache.block_size
    total = int(stats.get("num_total_blocks", 0) or 0)
    spec = cfg.spec
    return {
        "config": {
            "model": serving.settings.served_model_name, "model_path": cfg.model, "draft": spec.draft,
            "draft_format": serving.aengine.draft_format,
            "policy": spec.policy, "num_steps": spec.num_steps, "topk": spec.topk,
            "num_draft_tokens": spec.resolved_num_draft_tokens,
            "spec_disable_batch_size": spec.spec_disable_batch_size,
            "spec_simulate_accept_rate": spec.simulate_accept_rate,
            "max_model_len": serving.aengine.max_model_len, "block_size": block_size,
            "num_kv_blocks": total, "kv_capacity_tokens": total * block_size,
            "max_num_seqs": cfg.scheduler.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "enable_prefix_caching": cfg.cache.enable_prefix_caching,
            "device": cfg.device, "dtype": cfg.dtype, "tensor_parallel_size": cfg.tensor_parallel_size,
            "enable_expert_parallel": cfg.enable_expert_parallel,
            "max_queue_len": serving.settings.max_queue_len,
            "max_prompts_per_request": serving.settings.max_prompts_per_request,
            "generation_config": cfg.generation_config,
            "sampling_defaults": {**BUILTIN_SAMPLING_DEFAULTS, **serving.aengine.sampling_defaults},
        },
        # What the policy knows now; for auto: its cost table (step_ms: draft length -> {batch
        # size bucket: ms}), acceptance length per draft length (tau) and last goodputs.
        "policy": {"name": spec.policy, **(stats.get("policy_state") or {})},
        "stats": {**stats, "avg_accept_length": stats.get("accept_length", 0.0),
                  "num_free_blocks": stats.get("num_free_blocks", 0), "num_total_blocks": total,
                  "num_inflight": serving.aengine.num_inflight},
    }
