"""Architecture registry: config.json `architectures[0]` -> (model class, arch flags)."""
from __future__ import annotations

import json
from pathlib import Path

from adaspec.models.llama import LlamaForCausalLM, ModelArch, ModelSpec
from adaspec.models.moe import MOE_PARSERS, MoeForCausalLM

MODEL_REGISTRY: dict[str, tuple[type, ModelArch]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, ModelArch(o_bias_from_attention_bias=True, reads_mlp_bias=True)),
    "MistralForCausalLM": (LlamaForCausalLM, ModelArch()),
    "Qwen2ForCausalLM": (LlamaForCausalLM, ModelArch(qkv_bias=True)),
    "Qwen3ForCausalLM": (LlamaForCausalLM, ModelArch(qk_norm=True, o_bias_from_attention_bias=True)),
    "Phi3ForCausalLM": (LlamaForCausalLM, ModelArch(fused_checkpoint=True)),   # Phi-3, Phi-4 (default rope)
    # Mixture of experts (models/moe.py; each reads its routing options with MOE_PARSERS[arch]).
    "Qwen2MoeForCausalLM": (MoeForCausalLM, ModelArch()),
    "Qwen3MoeForCausalLM": (MoeForCausalLM, ModelArch(qk_norm=True)),
    "MixtralForCausalLM": (MoeForCausalLM, ModelArch()),
    "Glm4MoeForCausalLM": (MoeForCausalLM, ModelArch()),
}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: a model directory needs a config.json") from None


def rope_parameters(cfg: dict) -> dict:
    """transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`
    (and a top-level `partial_rotary_factor`, as GLM-4.5 publishes it, or
    `original_max_position_embeddings`, as Phi-3 does)."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    if cfg.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if params["rope_type"] == "su":   # Phi-3's first name for longrope
        params["rope_type"] = "longrope"
    if cfg.get("original_max_position_embeddings") is not None:   # Phi-3 keeps it at the top level
        params.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


# Which layers slide when a config names no `layer_types` (older configs): transformers' own
# rule per architecture; any other architecture slides in every layer.
_WINDOW_LAYERS = {
    "Qwen2ForCausalLM": lambda i, cfg: i >= cfg.get("max_window_layers", 28),
    "Qwen3ForCausalLM": lambda i, cfg: i >= cfg.get("max_window_layers", 28),
    "Qwen2MoeForCausalLM": lambda i, cfg: i % 2 == 0 and i < cfg.get("max_window_layers", 28),
}


def sliding_windows(cfg: dict, arch: str, num_layers: int) -> tuple:
    """Per layer: its attention window in tokens, or None (full attention)."""
    window = cfg.get("sliding_window")
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        window = None   # Qwen configs carry a window that only use_sliding_window turns on
    if not window:
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    slides = _WINDOW_LAYERS.get(arch, lambda i, cfg: True)
    return tuple(window if slides(i, cfg) else None for i in range(num_layers))


def eos_ids(model_dir: Path, cfg: dict) -> tuple:
    ids = None
    gen = model_dir / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = cfg.get("eos_token_id")
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (ids,)


# generation_config.json fields that map onto SamplingParams (same names, same meaning).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                             "frequency_penalty")
# Fields we cannot honour: named in a warning rather than dropped without a word.
GENERATION_UNSUPPORTED_FIELDS = ("no_repeat_ngram_size", "typical_p", "epsilon_cutoff", "eta_cutoff")


def generation_defaults(model_dir: str | Path) -> tuple[dict, list[str]]:
    """The sampling defaults a model ships in `generation_config.json` (vLLM's
    `--generation-config auto`): ({field: value} for temperature/top_p/top_k/min_p present in
    the file, [names of fields it sets that adaspec cannot apply]). No file -> ({}, []).

    `do_sample` is not consulted (vLLM does not either): Llama-3.1 ships do_sample=true with
    temperature 0.6 / top_p 0.9, and a request that wants greedy asks for temperature 0.
    Neutral values (a penalty of 1.0, top_k 0) are not reported as unsupported."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}, []
    try:
        gen = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    out = {}
    for name in GENERATION_DEFAULT_FIELDS:
        value = gen.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {name}={value!r} is not a number")
        out[name] = int(value) if name == "top_k" else float(value)
    neutral = {"no_repeat_ngram_size": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}
    ignored = [n for n in GENERATION_UNSUPPORTED_FIELDS if gen.get(n) not in (None, neutral[n])]
    return out, ignored


def parse_model_spec(model_dir: str | Path) -> tuple[ModelSpec, type]:
    """Read config.json into a ModelSpec and pick the model class. Unknown arch -> ValueError."""
    model_dir = Path(model_dir)
    cfg = read_json(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in MODEL_REGISTRY), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r} in {model_dir}/config.json; "
                         f"supported: {sorted(MODEL_REGISTRY)}")
    klass, flags = MODEL_REGISTRY[arch]
    nh = cfg["num_attention_heads"]
    L = cfg["num_hidden_layers"]
    moe, over = MOE_PARSERS[arch](cfg, L) if arch in MOE_PARSERS else (None, {})
    rope = rope_parameters(cfg)
    if "partial_rotary_default" in over:  # GLM-4.5: transformers' default when the config has none
        rope.setdefault("partial_rotary_factor", over.pop("partial_rotary_default"))
    spec = ModelSpec(
        architecture=arch,
        hidden_size=cfg["hidden_size"],
        num_layers=L,
        num_heads=nh,
        num_kv_heads=cfg.get("num_key_value_heads") or nh,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // nh,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_parameters=rope,
        max_position=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=over.get("qkv_bias", flags.qkv_bias or bool(cfg.get("attention_bias", False))),
        qk_norm=over.get("qk_norm", flags.qk_norm),
        sliding_windows=sliding_windows(cfg, arch, L),
        eos_token_ids=eos_ids(model_dir, cfg),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        hidden_act=cfg.get("hidden_act", "silu"),
        moe=moe,
        o_bias=flags.o_bias_from_attention_bias and bool(cfg.get("attention_bias", False)),
        mlp_bias=flags.reads_mlp_bias and bool(cfg.get("mlp_bias", False)),
        fused_checkpoint=flags.fused_checkpoint,
    )
    if spec.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {spec.hidden_act!r} (only silu)")
    return spec, klass
