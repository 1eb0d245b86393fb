"""EAGLE-3 heads on disk: `load_eagle3` reads every published layout into an `Eagle3Head`;
`save_eagle3` writes the layout adaspec's trainer (and the test helpers) produce.

Upstream layouts read (told apart by config and tensor content, not by architecture name
alone; what cannot be run is refused, naming the key):

  EAGLE (yuhuili/EAGLE3-*)   architectures ["LlamaForCausalLM"], `draft_vocab_size`, tensors
                             fc / midlayer.* / norm / lm_head / d2t / t2d, usually only as
                             pytorch_model.bin, no embedding.
  SpecForge / SGLang         architectures ["LlamaForCausalLMEagle3"], same tensors in
                             safetensors; `eagle_config.eagle_aux_hidden_state_layer_ids` names
                             layer *outputs* (SGLang captures the input of id + 1). SpecForge's
                             EAGLE-3.1 adds `fc_norm` (one RMSNorm per aux feature before fc,
                             tensors fc_norm.{i}.weight) and `norm_output` (false: lm_head reads
                             the un-normed hidden).
  vLLM                       architectures ["Eagle3LlamaForCausalLM"]; `norm_before_residual`,
                             `num_hidden_layers` > 1 (layers.{i}.*, layer 0 takes 2H), and a
                             top-level `eagle_aux_hidden_state_layer_ids` naming layer *inputs*
                             (vLLM captures hidden+residual before layer id).
  speculators                architectures ["Eagle3Speculator"], `speculators_model_type`
                             "eagle3": the layer fields live in `transformer_layer_config`
                             (Llama, or Qwen3 with per-head q_norm/k_norm); layers.{i}.*,
                             `norm_before_residual`, `norm_before_fc` (one RMSNorm over the
                             concatenated features, tensor input_norm.weight), `fc_norm`,
                             `norm_output` (true: the *normed* hidden is fed to the next step),
                             `embed_requires_grad`; ids as in vLLM (layer inputs). A SpecForge
                             EAGLE-3.1 head converted by speculators keeps SpecForge's meaning
                             of `norm_output`: read so when the config names SpecForge as its
                             source (`PROVENANCE_KEYS`), otherwise a warning says how it was read.

Refused: sliding-window draft layers, biases, activations other than silu, heads fed with
the last hidden state only, and any tensor that nothing would read.

Embedding rule (as vLLM: a checkpoint's embed_tokens is used when present), except that an
exact copy of the target's (after rounding to either side's dtype) is dropped and the
target's shared instead: trainers that freeze the embedding (EAGLE, SpecForge, speculators by
default) save such a copy. The load log says which embedding is used and why.

Written layout (`save_eagle3`): SpecForge's, which SGLang, vLLM and adaspec load: config.json
(`LlamaForCausalLMEagle3`, the target's layer shape, `draft_vocab_size`) and model.safetensors
(fc, midlayer.*, norm, lm_head, d2t/t2d with a reduced vocabulary). Non-default aux layers are
written twice, as SGLang and vLLM each read them: `eagle_config.eagle_aux_hidden_state_layer_ids`
(layer outputs) and the top-level `eagle_aux_hidden_state_layer_ids` (layer inputs).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from adaspec.models.llama import ModelSpec
from adaspec.models.loader import checkpoint_tensors, init_dummy, load_state
from adaspec.models.quantized import read_quantization
from adaspec.models.registry import MODEL_REGISTRY, read_json, rope_parameters, sliding_windows
from adaspec.spec_decode.eagle3 import Eagle3Format, Eagle3Head

log = logging.getLogger("adaspec")

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
# Tensors a head may carry that inference does not read, and why; anything else unused is an error.
TRAINING_ONLY_TENSORS = {
    "verifier_norm.weight": "speculators' copy of the target's final norm (a training teacher)",
    "verifier_lm_head.weight": "speculators' copy of the target's lm_head (a training teacher)",
}
# speculators `transformer_layer_config.model_type` -> the architecture whose layer it is.
LAYER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Config keys (top level or in `speculators_config`) that may say where a converted head came from.
PROVENANCE_KEYS = ("source", "converted_from", "source_format", "original_format", "trained_with")


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The capture layers SGLang, vLLM and EAGLE assume when a config names none: the inputs
    of layers 2, L/2 and L-3 (index L = the final pre-norm hidden)."""
    L = num_target_layers
    return (2, L // 2, L - 3)


def distinct_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """Three distinct capture layers where the upstream default repeats one (targets of fewer
    than 7 layers: (2, L/2, L-3) is (2, 3, 3) for 6 layers, (2, 2, 1) for 4): the inputs of
    layers 1, L/2 and L-1, or of 0, 1, 2 for 2-3 layers. Heads for such targets write them."""
    L = num_target_layers
    upstream = default_aux_layers(L)
    if len(set(upstream)) == 3 and all(0 <= i <= L for i in upstream):
        return upstream
    if L < 2:
        raise ValueError(f"a {L}-layer target has fewer than 3 distinct layer inputs to capture")
    return (1, L // 2, L - 1) if L >= 4 else (0, 1, 2)


# ---- reading a head's config --------------------------------------------------------------------

def _layer_architecture(layer_cfg: dict, draft_dir: Path) -> str:
    arch = next((a for a in layer_cfg.get("architectures") or [] if a in MODEL_REGISTRY), None)
    kind = layer_cfg.get("model_type", "llama")
    if arch is None and kind not in LAYER_ARCHITECTURES:
        raise ValueError(f"{draft_dir}: transformer_layer_config model_type={kind!r} is not supported; "
                         f"draft layers may be {sorted(LAYER_ARCHITECTURES)}")
    return arch or LAYER_ARCHITECTURES[kind]


def _flatten_config(cfg: dict, draft_dir: Path) -> tuple[dict, str, str]:
    """(Llama-style flat config, upstream layout name, architecture of the draft layers).
    speculators nests the layer fields; every other layout has Llama layers."""
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") is not None or "Eagle3Speculator" in archs:
        kind = cfg.get("speculators_model_type")
        if kind != "eagle3":
            raise ValueError(f"{draft_dir}: speculators_model_type={kind!r} is not supported; "
                             f"adaspec runs 'eagle3' speculators only")
        layer_cfg = cfg.get("transformer_layer_config")
        if not isinstance(layer_cfg, dict):
            raise ValueError(f"{draft_dir}: speculators config lacks transformer_layer_config")
        flat = dict(layer_cfg)
        for key, value in cfg.items():
            if key not in ("transformer_layer_config", "architectures"):
                flat[key] = value
        return flat, "speculators Eagle3Speculator", _layer_architecture(layer_cfg, draft_dir)
    if "Eagle3LlamaForCausalLM" in archs:
        return dict(cfg), "vLLM Eagle3LlamaForCausalLM", "LlamaForCausalLM"
    if "LlamaForCausalLMEagle3" in archs:
        return dict(cfg), "SpecForge/SGLang LlamaForCausalLMEagle3", "LlamaForCausalLM"
    return dict(cfg), f"EAGLE original ({', '.join(archs) or 'no architectures'} with an fc layer)", "LlamaForCausalLM"


def _aux_layers(cfg: dict, num_target_layers: int, draft_dir: Path) -> tuple[int, ...]:
    """Target layer indices whose inputs feed fc. Two spellings mean different things:
    `eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge/SGLang) names layer outputs,
    i.e. the input of id + 1; a top-level `eagle_aux_hidden_state_layer_ids` (vLLM,
    speculators) names layer inputs. Default (all three engines): `default_aux_layers`."""
    L = num_target_layers
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    from_nested = tuple(i + 1 for i in nested) if nested is not None else None
    from_top = tuple(top) if top is not None else None
    if from_nested is not None and from_top is not None and from_nested != from_top:
        raise ValueError(f"{draft_dir}: eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} (layer outputs) "
                         f"and eagle_aux_hidden_state_layer_ids={list(top)} (layer inputs) disagree")
    layers = from_nested or from_top or default_aux_layers(L)
    bad = [i for i in layers if not isinstance(i, int) or not 0 <= i <= L]
    if bad or not layers:
        raise ValueError(f"{draft_dir}: eagle_aux_hidden_state_layer_ids point outside the target's "
                         f"{L} layers (captured layer inputs would be {list(layers)})")
    return tuple(layers)


def _from_specforge(cfg: dict) -> bool:
    """Does a (speculators) config say it was converted from a SpecForge checkpoint?"""
    places = [cfg, cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}]
    return any("specforge" in str(p.get(k, "")).lower() for p in places for k in PROVENANCE_KEYS)


def _read_format(cfg: dict, layout: str, layer_arch: str, target_spec: ModelSpec, draft_dir: Path) -> Eagle3Format:
    speculators = layout.startswith("speculators")
    eagle_config = cfg.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state", True) is not True:
        raise ValueError(f"{draft_dir}: eagle_config.use_aux_hidden_state=false (a head fed with the last "
                         f"hidden state only) is not supported")
    for key in ("mlp_bias", "bias"):
        if cfg.get(key):
            raise ValueError(f"{draft_dir}: {key}=true is not supported (adaspec's draft layers have no such bias)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{draft_dir}: hidden_act={cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("fc_norm") and cfg.get("norm_before_fc"):
        raise ValueError(f"{draft_dir}: fc_norm and norm_before_fc are mutually exclusive")
    n = cfg.get("num_hidden_layers", 1)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{draft_dir}: num_hidden_layers={n!r} must be a positive integer")
    # The target's own rule (models/registry.py) says which layers slide; a draft layer that
    # would is refused rather than run with full attention. An explicit use_sliding_window=false
    # (Qwen configs copied into a Llama-layout head) means none does.
    if cfg.get("use_sliding_window") is not False and any(w is not None for w in sliding_windows(cfg, layer_arch, n)):
        raise ValueError(f"{draft_dir}: sliding-window draft layers are not supported (sliding_window="
                         f"{cfg.get('sliding_window')}, use_sliding_window={cfg.get('use_sliding_window')}, "
                         f"layer_types={cfg.get('layer_types')})")
    norm_output = cfg.get("norm_output")
    specforge_meaning = not speculators or _from_specforge(cfg)
    if speculators and specforge_meaning:
        layout += " (converted from SpecForge)"
    elif speculators and cfg.get("fc_norm") and norm_output is not None:
        log.warning("EAGLE-3 head %s: speculators config with fc_norm and norm_output=%s, read with speculators' "
                    "meaning (the normed hidden %s fed to the next step). A SpecForge EAGLE-3.1 head converted by "
                    "speculators means by norm_output whether lm_head reads the normed hidden; if this is one, "
                    "add \"source\": \"specforge\" to its config.json", draft_dir, norm_output,
                    "is" if norm_output else "is not")
    return Eagle3Format(
        layout=layout, num_layers=n, aux_layers=_aux_layers(cfg, target_spec.num_layers, draft_dir),
        fc_norm=bool(cfg.get("fc_norm", False)), norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        # The same key means two things: SpecForge's norm_output (default true) says whether
        # lm_head reads the normed hidden; speculators' (default false) whether the normed
        # hidden is what the next step gets.
        norm_logits=True if not specforge_meaning or norm_output is None else bool(norm_output),
        feed_normed=bool(norm_output) if not specforge_meaning else False,
        embed_trained=bool(cfg.get("embed_requires_grad", False)) if speculators else False)


# ---- checkpoint names ---------------------------------------------------------------------------

_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
_LATER = re.compile(r"^later_layers\.(\d+)\.(.*)$")


def _our_name(checkpoint_name: str) -> str:
    """Checkpoint name -> parameter name: drop a `model.` prefix; `midlayer.` and `layers.0.`
    are the first layer, `layers.{i}.` (i >= 1) the later ones."""
    name = checkpoint_name[len("model."):] if checkpoint_name.startswith("model.") else checkpoint_name
    m = _LAYER.match(name)
    if m:
        i = int(m.group(1))
        return f"midlayer.{m.group(2)}" if i == 0 else f"later_layers.{i - 1}.{m.group(2)}"
    return name


def _checkpoint_name(param_name: str) -> str:
    """Parameter name -> the name `save_eagle3` writes (SpecForge: midlayer.*, layers.{i}.*)."""
    m = _LATER.match(param_name)
    return f"layers.{int(m.group(1)) + 1}.{m.group(2)}" if m else param_name


def _looks_like_eagle3(ours: set[str]) -> bool:
    """Content test: an fc projection and a first layer with hidden_norm (EAGLE-3's fused input)."""
    return "fc.weight" in ours and "midlayer.hidden_norm.weight" in ours


def _vocab_map(tensors: dict[str, torch.Tensor], draft_vocab: int, vocab: int, draft_dir: Path) -> torch.Tensor:
    """d2t as a long tensor, checked against the target vocabulary and against t2d if present."""
    d2t = tensors.get("d2t")
    if d2t is None:
        raise ValueError(f"EAGLE-3 head {draft_dir} has draft_vocab_size={draft_vocab} but no d2t tensor")
    d2t = d2t.long()
    if d2t.shape != (draft_vocab,):
        raise ValueError(f"d2t in {draft_dir} has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
    target_ids = torch.arange(draft_vocab) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
        raise ValueError(f"d2t in {draft_dir} maps draft ids outside the target vocabulary")
    t2d = tensors.get("t2d")
    if t2d is not None:
        expected = torch.zeros(vocab, dtype=torch.bool)
        expected[target_ids] = True
        if t2d.shape != (vocab,) or not torch.equal(t2d.bool(), expected):
            raise ValueError(f"t2d in {draft_dir} does not mark exactly the target ids that d2t maps to")
    return d2t


def is_target_copy(own: torch.Tensor, target: torch.Tensor) -> bool:
    """True if a head's saved embedding is exactly the target's, up to rounding to either
    tensor's dtype (a copy saved in fp16 of a bf16 or fp32 target, or a target run in a lower
    precision than the copy). A fine-tuned embedding, however lightly, is not a copy."""
    if own.shape != target.shape:
        return False
    t = target.detach().to("cpu")
    return any(torch.equal(own.to(d), t.to(d)) for d in {own.dtype, t.dtype})


def load_eagle3(draft_dir: str | Path, target_spec: ModelSpec, target_embed: nn.Embedding,
                device: torch.device, dtype: torch.dtype, load_format: str = "auto", seed: int = 0) -> Eagle3Head:
    """Load an EAGLE-3 head for `target_spec` from any layout in the module docstring.
    Everything wrong (shapes, unsupported variants, checkpoint tensors nothing would read)
    is a ValueError at load time naming the key."""
    draft_dir = Path(draft_dir)
    raw = read_json(draft_dir / "config.json")
    cfg, layout, layer_arch = _flatten_config(raw, draft_dir)
    tensors: dict[str, torch.Tensor] = {}
    original: dict[str, str] = {}  # our name -> the checkpoint's, for messages
    if load_format != "dummy":
        for name, t in checkpoint_tensors(draft_dir, quant=read_quantization(raw)):   # FP8 heads: dequantized
            ours = _our_name(name)
            if ours in tensors:
                raise ValueError(f"EAGLE-3 head {draft_dir} has two tensors for {ours!r}: "
                                 f"{original[ours]!r} and {name!r}")
            tensors[ours], original[ours] = t, name
    archs = raw.get("architectures") or []
    known_arch = any(a in EAGLE3_ARCHITECTURES for a in archs)
    if load_format == "dummy":
        if not known_arch and "draft_vocab_size" not in cfg:
            raise ValueError(f"{draft_dir} is not an EAGLE-3 head: architectures={archs}")
    elif not _looks_like_eagle3(set(tensors)):
        raise ValueError(f"{draft_dir} is not an EAGLE-3 head: architectures={archs}, and its checkpoint has no "
                         f"fc.weight with a first layer's hidden_norm (midlayer.* or layers.0.*)")
    fmt = _read_format(cfg, layout, layer_arch, target_spec, draft_dir)

    if cfg.get("vocab_size", target_spec.vocab_size) != target_spec.vocab_size:
        raise ValueError(f"EAGLE-3 head {draft_dir} has vocab_size={cfg['vocab_size']} but the target has "
                         f"{target_spec.vocab_size}")
    target_hidden = cfg.get("target_hidden_size") or target_spec.hidden_size
    if target_hidden != target_spec.hidden_size:
        raise ValueError(f"EAGLE-3 head {draft_dir} expects target_hidden_size={target_hidden}, the target has "
                         f"{target_spec.hidden_size}")
    nh = cfg["num_attention_heads"]
    layer_flags = MODEL_REGISTRY[layer_arch][1]
    spec = replace(
        target_spec, architecture=layout, hidden_size=cfg["hidden_size"], num_layers=fmt.num_layers,
        num_heads=nh, num_kv_heads=cfg.get("num_key_value_heads") or nh,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // nh,
        intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_parameters=rope_parameters(cfg), max_position=cfg.get("max_position_embeddings", target_spec.max_position),
        qkv_bias=layer_flags.qkv_bias or bool(cfg.get("attention_bias", False)), qk_norm=layer_flags.qk_norm,
        sliding_windows=(None,) * fmt.num_layers, o_bias=False, mlp_bias=False, moe=None)
    draft_vocab = cfg.get("draft_vocab_size") or target_spec.vocab_size

    own = tensors.get("embed_tokens.weight")
    copy = own is not None and not fmt.embed_trained and (
        target_embed.matches(own, is_target_copy) if hasattr(target_embed, "matches")  # a vocabulary shard
        else is_target_copy(own, target_embed.weight))
    own_embed = own is not None and not copy
    if fmt.embed_trained and own is None and load_format != "dummy":
        raise ValueError(f"EAGLE-3 head {draft_dir} says embed_requires_grad=true but has no embed_tokens.weight")
    if not own_embed and spec.hidden_size != target_spec.hidden_size:
        raise ValueError(f"EAGLE-3 head {draft_dir} has hidden_size={spec.hidden_size} != target's "
                         f"{target_spec.hidden_size} and no embed_tokens of its own")
    # Aux features are captured in layer order, each layer once (as vLLM, SGLang and EAGLE do),
    # whatever order the config lists them in; fc is sized by the distinct layers.
    distinct = tuple(sorted(set(fmt.aux_layers)))
    fc = tensors.get("fc.weight")
    if len(distinct) != len(fmt.aux_layers) and fc is not None and fc.shape[-1] == len(fmt.aux_layers) * target_hidden:
        raise ValueError(f"EAGLE-3 head {draft_dir} reads aux layers {list(fmt.aux_layers)} (layer inputs), which "
                         f"repeat a layer, and its fc takes {len(fmt.aux_layers)} features; SGLang, vLLM and EAGLE "
                         f"capture each layer once ({len(distinct)} features). Retrain it on distinct layers "
                         f"(adaspec train-draft --aux-layers)")
    fmt = replace(fmt, aux_layers=distinct)
    head = Eagle3Head(spec, target_hidden, draft_vocab, own_embed, fmt.aux_layers, fmt).to(device=device, dtype=dtype)
    if load_format == "dummy":
        init_dummy(head, seed + 1)
    else:
        _fill(head, tensors, original, draft_dir, fmt, copy)
        if draft_vocab != target_spec.vocab_size:
            head.d2t = _vocab_map(tensors, draft_vocab, target_spec.vocab_size, draft_dir).to(device)
    if draft_vocab == target_spec.vocab_size:
        head.d2t = torch.zeros(draft_vocab, dtype=torch.long, device=device)
    object.__setattr__(head, "target_embed", target_embed)  # shared, not a submodule of the head
    embedding = ("the head's own embed_tokens" if own_embed else
                 "the target's (the checkpoint's embed_tokens is an exact copy)" if copy else
                 "the target's (the checkpoint has no embed_tokens)")
    log.info("EAGLE-3 head %s: %s, %d %s layer(s), aux layer inputs %s, embedding: %s%s", draft_dir, fmt.layout,
             fmt.num_layers, layer_arch.removesuffix("ForCausalLM"), list(fmt.aux_layers), embedding,
             "".join(f", {k}" for k in ("fc_norm", "norm_before_fc", "norm_before_residual", "feed_normed")
                     if getattr(fmt, k)) + ("" if fmt.norm_logits else ", un-normed logits"))
    return head.eval()


def _fill(head: Eagle3Head, tensors: dict[str, torch.Tensor], original: dict[str, str], draft_dir: Path,
          fmt: Eagle3Format, embed_is_target_copy: bool) -> None:
    """Copy the checkpoint into `head` and account for every tensor: each one is loaded, is a
    vocabulary map, or is deliberately unused for a stated reason; anything else is an error
    (it would mean a variant we do not implement, silently crippling acceptance)."""
    params = {n for n, _ in head.named_parameters()}
    try:
        load_state(head, draft_dir, lambda n: n, tensors=tensors, check_unread=False)   # accounted below
    except ValueError as e:  # name the checkpoint's own keys, not ours
        msg = str(e)
        for ours, theirs in original.items():
            msg = msg.replace(repr(ours), repr(theirs))
        raise ValueError(msg) from None
    used = params | {"d2t", "t2d"}
    skipped = {n: why for n, why in TRAINING_ONLY_TENSORS.items() if n in tensors}
    if embed_is_target_copy:
        skipped["embed_tokens.weight"] = "an exact copy of the target's embedding (the target's is used)"
    if not fmt.norm_logits and not fmt.feed_normed:
        skipped["norm.weight"] = "loaded but unused: norm_output=false, lm_head reads the un-normed hidden"
    unused = sorted(original[n] for n in set(tensors) - used - set(skipped))
    if unused:
        raise ValueError(f"EAGLE-3 head {draft_dir} ({fmt.layout}) has tensor(s) adaspec would not use: {unused[:8]}; "
                         f"they belong to a variant adaspec does not implement")
    for name, why in skipped.items():
        if name in tensors:
            log.info("EAGLE-3 head %s: %s: %s", draft_dir, original[name], why)


# ---- writing a head -------------------------------------------------------------------------------

def eagle3_config(target_cfg: dict, *, num_layers: int = 1, aux_layers: tuple[int, ...] | None = None,
                  draft_vocab_size: int | None = None, torch_dtype: str = "float32") -> dict:
    """config.json of a head shaped like the target's layers (SpecForge layout). `aux_layers`
    are target layer *inputs*; None writes no ids (readers then use `default_aux_layers`)."""
    H, nh = target_cfg["hidden_size"], target_cfg["num_attention_heads"]
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "intermediate_size": target_cfg["intermediate_size"], "num_attention_heads": nh,
        "num_key_value_heads": target_cfg.get("num_key_value_heads", nh), "num_hidden_layers": num_layers,
        "vocab_size": target_cfg["vocab_size"], "draft_vocab_size": draft_vocab_size,
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 2048),
        "rope_theta": (target_cfg.get("rope_parameters") or {}).get("rope_theta", target_cfg.get("rope_theta", 10000.0)),
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": torch_dtype,
    }
    if aux_layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_layers]}  # SGLang: outputs
        cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)                             # vLLM: inputs
    return cfg


def head_tensors(head: Eagle3Head, t2d: torch.Tensor | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A head's weights under the names `save_eagle3` writes, in `dtype`, without an embedding
    (readers share the target's); d2t / t2d when `t2d` (a reduced draft vocabulary) is given."""
    out = {_checkpoint_name(k): v.detach().to("cpu", dtype) for k, v in head.state_dict().items()
           if not k.startswith("embed_tokens") and v.is_floating_point()}
    if t2d is not None:
        out["d2t"] = head.d2t.detach().cpu()
        out["t2d"] = t2d.detach().cpu()
    return out


def save_eagle3(path: str | Path, target_dir: str | Path, tensors: dict[str, torch.Tensor], *,
                aux_layers: tuple[int, ...] | None = None, draft_vocab_size: int | None = None,
                torch_dtype: str = "float32") -> Path:
    """Write a head for the target in `target_dir` (config.json + model.safetensors) to `path`.
    `tensors` are in checkpoint names (`head_tensors`); `torch_dtype` is what the config says
    they are. The config is written last, so a reader never sees it beside stale weights."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    later = {int(m.group(1)) for m in map(_LAYER.match, tensors) if m}
    cfg = eagle3_config(target_cfg, num_layers=1 + len(later - {0}), aux_layers=aux_layers,
                        draft_vocab_size=draft_vocab_size, torch_dtype=torch_dtype)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
