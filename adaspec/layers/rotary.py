"""Rotary position embeddings, with the scaling variants Llama-family checkpoints use.

`rope_parameters` follows transformers >= 5 (`{"rope_type", "rope_theta", ...}`); older
configs with `rope_theta` + `rope_scaling` are normalised by the model config parser."""
from __future__ import annotations

import math

import torch


# Each scaling: (inv_freq, params, the config's max position) -> (inv_freq, attention scaling,
# None or (inv_freq, position): the frequencies from that position on).

def _default(inv_freq: torch.Tensor, params: dict, max_pos: int) -> tuple:
    return inv_freq, 1.0, None


def _linear(inv_freq: torch.Tensor, params: dict, max_pos: int) -> tuple:
    return inv_freq / float(params["factor"]), 1.0, None


def _llama3(inv_freq: torch.Tensor, params: dict, max_pos: int) -> tuple:
    factor = float(params["factor"])
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    old_ctx = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0, None


def _yarn(inv_freq: torch.Tensor, params: dict, max_pos: int) -> tuple:
    dim = inv_freq.numel() * 2
    base = float(params["rope_theta"])
    factor = float(params["factor"])
    old_ctx = float(params.get("original_max_position_embeddings") or max_pos / factor)
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
    mscale = params.get("attention_factor")
    if mscale is None:
        mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def corr_dim(rot):
        return (dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv, float(mscale), None


def _longrope(inv_freq: torch.Tensor, params: dict, max_pos: int) -> tuple:
    """Phi-3 / Phi-4-mini: each frequency divided by its `short_factor` below the original
    context and by its `long_factor` from there on, by position. That is transformers' model
    with its KV cache: each forward takes the long set once its largest position passes the
    original context, and cached keys keep theirs. (transformers' `generate` instead drops the
    cache when a sequence passes the original context and recomputes all of it with the long
    set; a prompt longer than the original context is read with the long set throughout. Where
    a sequence crosses it, adaspec's output then differs from `generate`'s.)"""
    orig = int(params["original_max_position_embeddings"])
    factors = []
    for key in ("short_factor", "long_factor"):
        f = torch.tensor(params[key], dtype=torch.float32, device="cpu")   # (not the meta device of a model being built)
        if f.shape != inv_freq.shape:
            raise ValueError(f"rope {key} has {f.numel()} values; the rotary dimensions need {inv_freq.numel()}")
        factors.append(f)
    factor = params.get("factor") or max_pos / orig
    scale = params.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return inv_freq / factors[0], float(scale), (inv_freq / factors[1], orig)


ROPE_SCALINGS = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn, "longrope": _longrope}


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, rope_parameters: dict, max_position: int, partial: float = 1.0):
        super().__init__()
        rot_dim = int(head_dim * partial)
        theta = float(rope_parameters.get("rope_theta", 10000.0))
        rtype = rope_parameters.get("rope_type", rope_parameters.get("type", "default")) or "default"
        if rtype not in ROPE_SCALINGS:
            raise ValueError(f"unsupported rope_type {rtype!r}; supported: {sorted(ROPE_SCALINGS)}")
        # Built on the CPU in float32 and kept out of the module's buffers, so neither a meta
        # device context nor `.to(bfloat16)` can touch it.
        inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim))
        inv_freq, self.attention_scaling, self.long = ROPE_SCALINGS[rtype](
            inv_freq, {**rope_parameters, "rope_theta": theta}, max_position)
        self.rot_dim = rot_dim
        self.inv_freq = inv_freq
        self._on: dict[torch.device, tuple] = {}

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """[..., rot_dim / 2] angles of `positions` (float32, on their device)."""
        on = self._on.get(positions.device)
        if on is None:
            long = None if self.long is None else (self.long[0].to(positions.device), self.long[1])
            on = self._on[positions.device] = (self.inv_freq.to(positions.device), long)
        inv, long = on
        pos = positions.float().unsqueeze(-1)
        if long is not None:   # longrope: other frequencies from the original context on
            inv = torch.where(pos >= long[1], long[0], inv)
        return pos * inv

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self._freqs(positions)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def cos_sin_cache(self, max_positions: int, device: torch.device) -> torch.Tensor:
        """[max_positions, rot_dim] float32: cos(freqs) | sin(freqs), attention scaling applied
        (the layout `fused_ops.rotary_qkv_store` reads by position)."""
        freqs = self._freqs(torch.arange(max_positions, dtype=torch.float32, device="cpu"))
        return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling).to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, rot_dim] (neox / HF 'rotate_half' layout)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    out = xr * cos + rotated * sin
    return torch.cat([out, xp], dim=-1) if xp.numel() else out
