"""Tiny random MoE checkpoints written by transformers itself (save_pretrained, per-expert
safetensors as published), for the MoE tests."""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
              max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)

#: name -> (architecture, config class, config kwargs): together they cover shared experts
#: (gated and not), grouped selection with a correction bias, dense-first and mlp-only layers,
#: a sparse step, partial rotary, q/k norm, qkv bias, renormalised and raw top-k, top-1/2/4.
MOE_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], head_dim=16)),
    "qwen3_moe_raw": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=4,
        norm_topk_prob=False, decoder_sparse_step=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        num_hidden_layers=3, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
        head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "glm4_moe_top1": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=1, n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=0,
        routed_scaling_factor=1.0, norm_topk_prob=False)),
}


def make_moe_model(path, name: str, *, seed: int = 0, init_std: float = 0.2, shard_bytes: int | None = None,
                   **overrides) -> Path:
    """Write MOE_CONFIGS[name] (with `overrides`) with random weights to `path`; returns it.
    Router biases (GLM's e_score_correction_bias) are random, so they change the selection."""
    import transformers

    arch, cfg_name, kw = MOE_CONFIGS[name]
    path = Path(path)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **kw, **overrides}, initializer_range=init_std)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    model.save_pretrained(str(path), **({"max_shard_size": shard_bytes} if shard_bytes else {}))
    return path
