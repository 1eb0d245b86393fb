"""The EAGLE-3 draft head: decoder layer(s) fed with several of the target's hidden states.

Computation (one draft step; the pair at position p is (hidden_p, token_{p+1})):

    h0   = fc(cat(aux_1 .. aux_k))              first step only: the target's features
    x    = cat(input_layernorm(embed(token)), hidden_norm(h))
    h    = r + attn(x)          r = h, or hidden_norm(h) with norm_before_residual
    h    = h + mlp(post_attention_layernorm(h))
    h    = DecoderLayer_i(h)    for each further layer (a plain Llama layer of width H)
    logits = lm_head(norm(h))   over the draft vocabulary; target_id = draft_id + d2t[draft_id]
    next step's h = h (pre-norm), or norm(h) with speculators' norm_output

This module is the head as it runs; reading and writing the upstream checkpoint layouts is
`eagle3_checkpoint.py` (`load_eagle3`, `save_eagle3`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from adaspec.layers.rotary import RotaryEmbedding
from adaspec.models.llama import MLP, Attention, DecoderLayer, ModelSpec, RMSNorm


@dataclass(frozen=True)
class Eagle3Format:
    """How to run a head, normalised across the upstream layouts (see eagle3_checkpoint.py)."""

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
