"""The EAGLE-3 draft head: decoder layer(s) fed with several of the target's hidden states.

Computation (one draft step; the pair at position p is (hidden_p, token_{p+1})):

    h0   = fc(cat(aux_1 .. aux_k))              first step only: the target's features
    x    = cat(input_layernorm(embed(token)), hidden_norm(h))
    h    = r + attn(x)          r = h, or hidden_norm(h) with norm_before_residual
    h    = h + mlp(post_attention_layernorm(h))
    h    = DecoderLayer_i(h)    for each further layer (a plain Llama layer of width H)
    logits = lm_head(norm(h))   over the draft vocabulary; target_id = draft_id + d2t[draft_id]
    next step's h = h (pre-norm), or norm(h) with speculators' norm_output

Upstream layouts this loads (`load_eagle3` tells them apart by config and tensor content, not
by architecture name alone, and refuses what it cannot run, naming the key):

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
                             "eagle3": the Llama fields live in `transformer_layer_config`;
                             layers.{i}.*, `norm_before_residual`, `norm_before_fc` (one RMSNorm
                             over the concatenated features, tensor input_norm.weight), `fc_norm`,
                             `norm_output` (true: the *normed* hidden is fed to the next step),
                             `embed_requires_grad`; ids as in vLLM (layer inputs).

Embedding rule. SGLang always embeds draft tokens with the target's embedding; so do we,
unless the head was trained with its own: its checkpoint has `embed_tokens.weight` and that
tensor differs from the target's (beyond rounding to the checkpoint's dtype), or a speculators
config says `embed_requires_grad: true`. Trainers that freeze the embedding (EAGLE, SpecForge,
speculators by default) save a verbatim copy of the target's, which is then dropped.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from adaspec.layers.rotary import RotaryEmbedding
from adaspec.models.llama import MLP, Attention, DecoderLayer, ModelSpec, RMSNorm
from adaspec.models.loader import init_dummy, iter_tensors, load_state
from adaspec.models.registry import read_json, rope_parameters

log = logging.getLogger("adaspec")

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
# Tensors a head may carry that inference does not read, and why; anything else unused is an error.
TRAINING_ONLY_TENSORS = {
    "verifier_norm.weight": "speculators' copy of the target's final norm (a training teacher)",
    "verifier_lm_head.weight": "speculators' copy of the target's lm_head (a training teacher)",
}


@dataclass(frozen=True)
class Eagle3Format:
    """How to run a head, normalised across the upstream layouts (see the module docstring)."""

    layout: str                       # upstream name, for logs and /server_info
    num_layers: int = 1
    aux_layers: tuple[int, ...] = ()  # target layer indices whose *inputs* are captured
    fc_norm: bool = False             # RMSNorm on each aux feature before fc
    norm_before_fc: bool = False      # one RMSNorm over the concatenated aux features
    norm_before_residual: bool = False
    norm_logits: bool = True          # lm_head(norm(h)); SpecForge norm_output=false: lm_head(h)
    feed_normed: bool = False         # speculators norm_output=true: next step's h is norm(h)
    embed_trained: bool = False       # speculators embed_requires_grad


class Eagle3Layer(nn.Module):
    """The first draft layer: attention over cat(embedding, hidden) (width 2H)."""

    def __init__(self, spec: ModelSpec, norm_before_residual: bool = False):
        super().__init__()
        H = spec.hidden_size
        self.self_attn = Attention(spec, None, in_dim=2 * H)
        self.mlp = MLP(H, spec.intermediate_size)
        self.input_layernorm = RMSNorm(H, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, spec.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def attn_input(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)

    def residual(self, h: torch.Tensor) -> torch.Tensor:
        """What the attention output is added to: h, or hidden_norm(h) (vLLM / speculators
        `norm_before_residual`)."""
        return self.hidden_norm(h) if self.norm_before_residual else h

    def forward(self, emb, h, positions, cos_sin) -> torch.Tensor:
        x = self.attn_input(emb, h)
        h = self.residual(h) + self.self_attn(x, positions, cos_sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """`cache` (forward, write_kv) is a list with one (k, v) pair per draft layer."""

    def __init__(self, spec: ModelSpec, target_hidden: int, draft_vocab: int, own_embed: bool,
                 aux_layers: tuple[int, ...], fmt: Eagle3Format | None = None):
        super().__init__()
        fmt = fmt or Eagle3Format("adaspec", num_layers=1, aux_layers=aux_layers)
        self.spec = spec
        self.fmt = fmt
        H, k = spec.hidden_size, len(aux_layers)
        eps = spec.rms_norm_eps
        self.fc = nn.Linear(k * target_hidden, H, bias=False)
        self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, eps) for _ in range(k)) if fmt.fc_norm else None
        self.input_norm = RMSNorm(k * target_hidden, eps) if fmt.norm_before_fc else None
        self.midlayer = Eagle3Layer(spec, fmt.norm_before_residual)
        # Layers 1.. are plain Llama decoder layers (checkpoint names layers.{i}.*).
        self.later_layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(1, fmt.num_layers))
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long), persistent=False)
        self.embed_tokens = nn.Embedding(spec.vocab_size, H) if own_embed else None
        self.target_embed: nn.Embedding | None = None
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_parameters, spec.max_position)
        self.aux_layers = aux_layers  # target layer indices whose *inputs* are captured

    @property
    def num_layers(self) -> int:
        return 1 + len(self.later_layers)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self.target_embed)(tokens)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features [T, k*H_t] -> draft hidden [T, H] (the first step's input)."""
        aux = aux.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def fuse(self) -> None:
        """Merge q/k/v and gate/up of every draft layer (after loading, for inference)."""
        self.midlayer.self_attn.fuse()
        self.midlayer.mlp.fuse()
        for later in self.later_layers:
            later.self_attn.fuse()
            later.mlp.fuse()

    def prepare_rotary(self, max_positions: int, device: torch.device) -> None:
        self.cos_sin = self.rotary.cos_sin_cache(max_positions, device)

    def _cos_sin(self, device: torch.device) -> torch.Tensor:
        if getattr(self, "cos_sin", None) is None or self.cos_sin.device != device:
            self.prepare_rotary(self.spec.max_position, device)
        return self.cos_sin

    def write_kv(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: list,
                 slot_mapping: torch.Tensor) -> None:
        """Keep the draft cache fresh (negative slots are skipped). With one layer this runs no
        attention, MLP or lm_head: K and V of a pair depend only on the pair itself (the whole
        per-step cost of a request that does not speculate). Layers above the first see the
        context, so a deeper head runs its lower layers in full: the forward context must then
        describe real sequences, with `slot_mapping` as its slots."""
        cos_sin = self._cos_sin(h.device)
        emb = self.embed(tokens)
        layer = self.midlayer
        if not len(self.later_layers):
            layer.self_attn.store_kv(layer.attn_input(emb, h), positions, cos_sin, cache[0], slot_mapping)
            return
        x = layer(emb, h, positions, cos_sin)
        for later in self.later_layers[:-1]:
            x = later.full(x, positions, cos_sin)
        last = self.later_layers[-1]
        last.self_attn.store_kv(last.input_layernorm(x), positions, cos_sin, cache[-1], slot_mapping)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step (metadata and the per-layer caches come from the forward context).
        Returns (draft logits over the draft vocabulary, next step's hidden)."""
        cos_sin = self._cos_sin(h.device)
        h = self.midlayer(self.embed(tokens), h, positions, cos_sin)
        for later in self.later_layers:
            h = later.full(h, positions, cos_sin)
        normed = self.norm(h)
        logits = self.lm_head(normed if self.fmt.norm_logits else h).float()
        return logits, (normed if self.fmt.feed_normed else h)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


# ---- reading a head's config --------------------------------------------------------------------

def _flatten_config(cfg: dict, draft_dir: Path) -> tuple[dict, str]:
    """(Llama-style flat config, upstream layout name). speculators nests the layer fields."""
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
        return flat, "speculators Eagle3Speculator"
    if "Eagle3LlamaForCausalLM" in archs:
        return dict(cfg), "vLLM Eagle3LlamaForCausalLM"
    if "LlamaForCausalLMEagle3" in archs:
        return dict(cfg), "SpecForge/SGLang LlamaForCausalLMEagle3"
    return dict(cfg), f"EAGLE original ({', '.join(archs) or 'no architectures'} with an fc layer)"


def _aux_layers(cfg: dict, num_target_layers: int, draft_dir: Path) -> tuple[int, ...]:
    """Target layer indices whose inputs feed fc. Two spellings mean different things:
    `eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge/SGLang) names layer outputs,
    i.e. the input of id + 1; a top-level `eagle_aux_hidden_state_layer_ids` (vLLM,
    speculators) names layer inputs. Default (all three engines): inputs of 2, L/2, L-3."""
    L = num_target_layers
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    from_nested = tuple(i + 1 for i in nested) if nested is not None else None
    from_top = tuple(top) if top is not None else None
    if from_nested is not None and from_top is not None and from_nested != from_top:
        raise ValueError(f"{draft_dir}: eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} (layer outputs) "
                         f"and eagle_aux_hidden_state_layer_ids={list(top)} (layer inputs) disagree")
    layers = from_nested or from_top or (2, L // 2, L - 3)
    bad = [i for i in layers if not isinstance(i, int) or not 0 <= i <= L]
    if bad or not layers:
        raise ValueError(f"{draft_dir}: eagle_aux_hidden_state_layer_ids point outside the target's "
                         f"{L} layers (captured layer inputs would be {list(layers)})")
    return tuple(layers)


def _read_format(cfg: dict, layout: str, target_spec: ModelSpec, draft_dir: Path) -> Eagle3Format:
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
    if cfg.get("sliding_window") and any(t == "sliding_attention" for t in cfg.get("layer_types") or []):
        raise ValueError(f"{draft_dir}: sliding-window draft layers (layer_types, sliding_window) are not supported")
    if cfg.get("fc_norm") and cfg.get("norm_before_fc"):
        raise ValueError(f"{draft_dir}: fc_norm and norm_before_fc are mutually exclusive")
    n = cfg.get("num_hidden_layers", 1)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{draft_dir}: num_hidden_layers={n!r} must be a positive integer")
    norm_output = cfg.get("norm_output")
    return Eagle3Format(
        layout=layout, num_layers=n, aux_layers=_aux_layers(cfg, target_spec.num_layers, draft_dir),
        fc_norm=bool(cfg.get("fc_norm", False)), norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        # The same key means two things: SpecForge's norm_output (default true) says whether
        # lm_head reads the normed hidden; speculators' (default false) whether the normed
        # hidden is what the next step gets.
        norm_logits=True if speculators or norm_output is None else bool(norm_output),
        feed_normed=bool(norm_output) if speculators else False,
        embed_trained=bool(cfg.get("embed_requires_grad", False)) if speculators else False)


# ---- checkpoint names ---------------------------------------------------------------------------

_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


def _our_name(checkpoint_name: str) -> str:
    """Checkpoint name -> parameter name: drop a `model.` prefix; `midlayer.` and `layers.0.`
    are the first layer, `layers.{i}.` (i >= 1) the later ones."""
    name = checkpoint_name[len("model."):] if checkpoint_name.startswith("model.") else checkpoint_name
    m = _LAYER.match(name)
    if m:
        i = int(m.group(1))
        return f"midlayer.{m.group(2)}" if i == 0 else f"later_layers.{i - 1}.{m.group(2)}"
    return name


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


def _embedding_differs(own: torch.Tensor, target: torch.Tensor) -> bool:
    """True if a head's saved embedding is not a copy of the target's. A copy may have been
    rounded to the head's checkpoint dtype (fp16/bf16), so compare at that precision."""
    if own.shape != target.shape:
        return True
    t = target.detach().to("cpu", own.dtype).float()
    return not torch.allclose(own.float(), t, rtol=1e-2, atol=1e-3)


def load_eagle3(draft_dir: str | Path, target_spec: ModelSpec, target_embed: nn.Embedding,
                device: torch.device, dtype: torch.dtype, load_format: str = "auto", seed: int = 0) -> Eagle3Head:
    """Load an EAGLE-3 head for `target_spec` from any layout in the module docstring.
    Everything wrong (shapes, unsupported variants, checkpoint tensors nothing would read)
    is a ValueError at load time naming the key."""
    draft_dir = Path(draft_dir)
    raw = read_json(draft_dir / "config.json")
    cfg, layout = _flatten_config(raw, draft_dir)
    tensors: dict[str, torch.Tensor] = {}
    original: dict[str, str] = {}  # our name -> the checkpoint's, for messages
    if load_format != "dummy":
        for name, t in iter_tensors(draft_dir):
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
    fmt = _read_format(cfg, layout, target_spec, draft_dir)

    if cfg.get("vocab_size", target_spec.vocab_size) != target_spec.vocab_size:
        raise ValueError(f"EAGLE-3 head {draft_dir} has vocab_size={cfg['vocab_size']} but the target has "
                         f"{target_spec.vocab_size}")
    target_hidden = cfg.get("target_hidden_size") or target_spec.hidden_size
    if target_hidden != target_spec.hidden_size:
        raise ValueError(f"EAGLE-3 head {draft_dir} expects target_hidden_size={target_hidden}, the target has "
                         f"{target_spec.hidden_size}")
    nh = cfg["num_attention_heads"]
    spec = replace(
        target_spec, architecture=layout, hidden_size=cfg["hidden_size"], num_layers=fmt.num_layers,
        num_heads=nh, num_kv_heads=cfg.get("num_key_value_heads") or nh,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // nh,
        intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_parameters=rope_parameters(cfg), max_position=cfg.get("max_position_embeddings", target_spec.max_position),
        qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=False, sliding_windows=(None,) * fmt.num_layers)
    draft_vocab = cfg.get("draft_vocab_size") or target_spec.vocab_size

    own = tensors.get("embed_tokens.weight")
    own_embed = own is not None and (fmt.embed_trained or spec.hidden_size != target_spec.hidden_size
                                     or _embedding_differs(own, target_embed.weight))
    if fmt.embed_trained and own is None and load_format != "dummy":
        raise ValueError(f"EAGLE-3 head {draft_dir} says embed_requires_grad=true but has no embed_tokens.weight")
    if not own_embed and spec.hidden_size != target_spec.hidden_size:
        raise ValueError(f"EAGLE-3 head {draft_dir} has hidden_size={spec.hidden_size} != target's "
                         f"{target_spec.hidden_size} and no embed_tokens of its own")
    head = Eagle3Head(spec, target_hidden, draft_vocab, own_embed, fmt.aux_layers, fmt).to(device=device, dtype=dtype)
    if load_format == "dummy":
        init_dummy(head, seed + 1)
    else:
        _fill(head, tensors, original, draft_dir, fmt, own is not None and not own_embed)
        if draft_vocab != target_spec.vocab_size:
            head.d2t = _vocab_map(tensors, draft_vocab, target_spec.vocab_size, draft_dir).to(device)
    if draft_vocab == target_spec.vocab_size:
        head.d2t = torch.zeros(draft_vocab, dtype=torch.long, device=device)
    object.__setattr__(head, "target_embed", target_embed)  # shared, not a submodule of the head
    log.info("EAGLE-3 head %s: %s, %d layer(s), aux layer inputs %s, %s embedding%s", draft_dir, fmt.layout,
             fmt.num_layers, list(fmt.aux_layers), "own" if own_embed else "target's",
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
        load_state(head, draft_dir, lambda n: n, tensors=tensors)
    except ValueError as e:  # name the checkpoint's own keys, not ours
        msg = str(e)
        for ours, theirs in original.items():
            msg = msg.replace(repr(ours), repr(theirs))
        raise ValueError(msg) from None
    used = params | {"d2t", "t2d"}
    skipped = {n: why for n, why in TRAINING_ONLY_TENSORS.items() if n in tensors}
    if embed_is_target_copy:
        skipped["embed_tokens.weight"] = "a copy of the target's embedding (the target's is used)"
    if not fmt.norm_logits and not fmt.feed_normed:
        skipped["norm.weight"] = "loaded but unused: norm_output=false, lm_head reads the un-normed hidden"
    unused = sorted(original[n] for n in set(tensors) - used - set(skipped))
    if unused:
        raise ValueError(f"EAGLE-3 head {draft_dir} ({fmt.layout}) has tensor(s) adaspec would not use: {unused[:8]}; "
                         f"they belong to a variant adaspec does not implement")
    for name, why in skipped.items():
        if name in tensors:
            log.info("EAGLE-3 head %s: %s: %s", draft_dir, original[name], why)
