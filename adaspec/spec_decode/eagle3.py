"""The EAGLE-3 draft head: one decoder layer fed with three of the target's hidden states.

Checkpoint format (SpecForge / SGLang / vLLM): `fc [H, 3*H_target]`, `midlayer.*` (attention
with input width 2H, hidden_norm, input_layernorm, post_attention_layernorm, MLP), `norm`,
`lm_head [Vd, H]`, `d2t [Vd]` (target_id = draft_id + d2t[draft_id]); `embed_tokens` usually
absent (the target's is shared).

Layer: x = cat(input_layernorm(embed(token)), hidden_norm(h)) -> attention -> + h ->
post_attention_layernorm -> MLP -> + ; the pre-norm result is the next step's h, and
norm -> lm_head gives draft logits. The pair at position p is (hidden_p, token_{p+1}).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from adaspec.layers.rotary import RotaryEmbedding
from adaspec.models.llama import MLP, Attention, ModelSpec, RMSNorm
from adaspec.models.loader import init_dummy, load_state
from adaspec.models.registry import read_json, rope_parameters

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class Eagle3Layer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        H = spec.hidden_size
        self.self_attn = Attention(spec, None, in_dim=2 * H)
        self.mlp = MLP(H, spec.intermediate_size)
        self.input_layernorm = RMSNorm(H, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, spec.rms_norm_eps)

    def attn_input(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)


class Eagle3Head(nn.Module):
    def __init__(self, spec: ModelSpec, target_hidden: int, draft_vocab: int, own_embed: bool,
                 aux_layers: tuple[int, ...]):
        super().__init__()
        self.spec = spec
        H = spec.hidden_size
        self.fc = nn.Linear(len(aux_layers) * target_hidden, H, bias=False)
        self.midlayer = Eagle3Layer(spec)
        self.norm = RMSNorm(H, spec.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long), persistent=False)
        self.embed_tokens = nn.Embedding(spec.vocab_size, H) if own_embed else None
        self.target_embed: nn.Embedding | None = None
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_parameters, spec.max_position)
        self.aux_layers = aux_layers  # target layer indices whose *inputs* are captured

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self.target_embed)(tokens)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features [T, 3H_t] -> draft hidden [T, H] (the first step's input)."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def fuse(self) -> None:
        self.midlayer.self_attn.fuse()
        self.midlayer.mlp.fuse()

    def prepare_rotary(self, max_positions: int, device: torch.device) -> None:
        self.cos_sin = self.rotary.cos_sin_cache(max_positions, device)

    def _cos_sin(self, device: torch.device) -> torch.Tensor:
        if getattr(self, "cos_sin", None) is None or self.cos_sin.device != device:
            self.prepare_rotary(self.spec.max_position, device)
        return self.cos_sin

    def write_kv(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: tuple,
                 slot_mapping: torch.Tensor) -> None:
        """Keep the draft cache fresh without running attention, MLP or lm_head: K and V of a
        pair depend only on the pair itself. This is the whole per-step cost of a request
        that does not speculate. Negative slots are skipped."""
        x = self.midlayer.attn_input(self.embed(tokens), h)
        self.midlayer.self_attn.store_kv(x, positions, self._cos_sin(x.device), cache, slot_mapping)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step (metadata and cache from the forward context). Returns (draft logits
        over the draft vocabulary, pre-norm hidden)."""
        layer = self.midlayer
        x = layer.attn_input(self.embed(tokens), h)
        h = h + layer.self_attn(x, positions, self._cos_sin(x.device))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)).float(), h

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def _aux_layers(cfg: dict, num_target_layers: int) -> tuple[int, ...]:
    L = num_target_layers
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        layers = [i + 1 for i in ids]  # config ids name layer *outputs*; we capture inputs
    else:
        layers = [2, L // 2, L - 3]
    return tuple(min(max(i, 0), L) for i in layers)


def _normalise_names(model_dir: Path) -> dict[str, str]:
    """Map checkpoint names to ours: accept `midlayer.`, `layers.0.` and a `model.` prefix."""
    from adaspec.models.loader import iter_tensors

    out = {}
    for name, _ in iter_tensors(model_dir):
        ours = name[len("model."):] if name.startswith("model.") else name
        if ours.startswith("layers.0."):
            ours = "midlayer." + ours[len("layers.0."):]
        out[ours] = name
    return out


def load_eagle3(draft_dir: str | Path, target_spec: ModelSpec, target_embed: nn.Embedding,
                device: torch.device, dtype: torch.dtype, load_format: str = "auto", seed: int = 0) -> Eagle3Head:
    """Load an EAGLE-3 head for `target_spec`; shape mismatches are ValueErrors at load time."""
    draft_dir = Path(draft_dir)
    cfg = read_json(draft_dir / "config.json")
    archs = cfg.get("architectures") or []
    if not any(a in EAGLE3_ARCHITECTURES for a in archs):
        raise ValueError(f"{draft_dir} is not an EAGLE-3 head: architectures={archs}, "
                         f"expected one of {EAGLE3_ARCHITECTURES}")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"EAGLE-3 head {draft_dir} has num_hidden_layers={cfg['num_hidden_layers']}, expected 1")
    if cfg.get("vocab_size", target_spec.vocab_size) != target_spec.vocab_size:
        raise ValueError(f"EAGLE-3 head {draft_dir} has vocab_size={cfg['vocab_size']} but the target has "
                         f"{target_spec.vocab_size}")
    target_hidden = cfg.get("target_hidden_size") or target_spec.hidden_size
    if target_hidden != target_spec.hidden_size:
        raise ValueError(f"EAGLE-3 head {draft_dir} expects target_hidden_size={target_hidden}, the target has "
                         f"{target_spec.hidden_size}")
    nh = cfg["num_attention_heads"]
    spec = replace(
        target_spec, architecture=archs[0], hidden_size=cfg["hidden_size"], num_layers=1, num_heads=nh,
        num_kv_heads=cfg.get("num_key_value_heads") or nh,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // nh,
        intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_parameters=rope_parameters(cfg), max_position=cfg.get("max_position_embeddings", target_spec.max_position),
        qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=False, sliding_windows=(None,))
    draft_vocab = cfg.get("draft_vocab_size") or target_spec.vocab_size
    names = _normalise_names(draft_dir) if load_format == "auto" else {}
    own_embed = "embed_tokens.weight" in names
    if not own_embed and spec.hidden_size != target_spec.hidden_size:
        raise ValueError(f"EAGLE-3 head {draft_dir} has hidden_size={spec.hidden_size} != target's "
                         f"{target_spec.hidden_size} and no embed_tokens of its own")
    aux = _aux_layers(cfg, target_spec.num_layers)
    head = Eagle3Head(spec, target_hidden, draft_vocab, own_embed, aux).to(device=device, dtype=dtype)
    if load_format == "dummy":
        init_dummy(head, seed + 1)
    else:
        load_state(head, draft_dir, lambda n: names.get(n, n))
        if draft_vocab != target_spec.vocab_size:
            if "d2t" not in names:
                raise ValueError(f"EAGLE-3 head {draft_dir} has draft_vocab_size={draft_vocab} but no d2t tensor")
            from adaspec.models.loader import iter_tensors
            d2t = next(t for n, t in iter_tensors(draft_dir) if n == names["d2t"]).long()
            if d2t.shape != (draft_vocab,):
                raise ValueError(f"d2t in {draft_dir} has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
            target_ids = torch.arange(draft_vocab) + d2t
            if int(target_ids.min()) < 0 or int(target_ids.max()) >= target_spec.vocab_size:
                raise ValueError(f"d2t in {draft_dir} maps draft ids outside the target vocabulary")
            head.d2t = d2t.to(device)
    if draft_vocab == target_spec.vocab_size:
        head.d2t = torch.zeros(draft_vocab, dtype=torch.long, device=device)
    object.__setattr__(head, "target_embed", target_embed)  # shared, not a submodule of the head
    return head.eval()
