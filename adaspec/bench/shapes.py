"""Model shapes for benchmarks with random weights (`load_format="dummy"`).

A *shape* is a target config.json and an EAGLE-3 head config.json; `write_shape_dirs` writes
them as two model directories (config only, no weights, no tokenizer) that the engine loads
with `load_format="dummy"`. Used by `benchmarks/engine_sweep.py`, `benchmarks/gpu_fast_path.py`
and `benchmarks/load_experiment.py`, so every GPU benchmark measures the same shape.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

#: Llama-3.1-8B (bf16) and an EAGLE-3 head of the same width with a 32k draft vocabulary.
LLAMA_8B_TARGET = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA_8B_HEAD = {
    "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "draft_vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}

#: Qwen3-30B-A3B (bf16, ~61 GB): 48 layers, all sparse, 128 experts of width 768, top-8
#: renormalised; the shape of ../shared/tools/moe_physics_probe.py. Its head follows the
#: published EAGLE-3 heads for this model (hidden 2048, head_dim 128, 32k draft vocabulary).
QWEN3_30B_A3B_TARGET = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN3_30B_A3B_HEAD = {
    "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "draft_vocab_size": 32000, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}

#: A 4-layer, 64-wide Llama and its head: the same code paths on a CPU in seconds.
TINY_TARGET = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
    "max_position_embeddings": 1024}
TINY_HEAD = {
    "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320}

SHAPES: dict[str, tuple[dict, dict]] = {
    "llama-8b": (LLAMA_8B_TARGET, LLAMA_8B_HEAD),
    "qwen3-30b-a3b": (QWEN3_30B_A3B_TARGET, QWEN3_30B_A3B_HEAD),
    "tiny": (TINY_TARGET, TINY_HEAD),
}


def write_shape_dirs(shape: str, root: str | os.PathLike | None = None) -> tuple[str, str]:
    """Write `shape`'s target and head configs to ROOT/target and ROOT/draft (ROOT: a new
    temporary directory when None); returns the two directories."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {sorted(SHAPES)}")
    root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix=f"adaspec-{shape}-"))
    out = []
    for name, cfg in zip(("target", "draft"), SHAPES[shape]):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        out.append(str(d))
    return out[0], out[1]
