"""FP8 checkpoints, read as published and dequantized to the model's dtype at load.

Formats (config.json `quantization_config.quant_method`):
  fp8                 DeepSeek-V3 / Qwen3-*-FP8 / transformers' FineGrainedFP8: `X.weight` in
                      float8 with `X.weight_scale_inv` per block of `weight_block_size` (or
                      one per tensor without it; vLLM's and AutoFP8's per-tensor files).
  compressed-tensors  llm-compressor (RedHatAI / neuralmagic): `X.weight` in float8 with
                      `X.weight_scale` per tensor, per output channel or per block; only
                      8-bit float weights (`format` float-quantized / naive-quantized).
  fbgemm_fp8          Meta's Llama-3.1-*-FP8: `X.weight_scale` per output channel.
Every other quantization method is a load error that names it: reading packed integers or
4-bit floats as plain weights would run a model of garbage.

Contract: `dequantize_stream` takes the checkpoint's (name, tensor) stream and gives the same
names with every float8 weight replaced by weight x scale (computed in float32, on `device`)
and the scales themselves dropped; the activation and KV-cache scales that FP8 kernels use
(`input_scale`, `k_scale`, ...) are dropped too, since the model computes in its own dtype
and keeps its KV cache there. A float8 weight without a scale, or a scale grid that does not
tile its weight, is a ValueError naming the tensor. Weights and scales may sit in different
shards, in either order.

What this is not: FP8 compute. The weights take the memory of the model's dtype (twice the
checkpoint's bytes); the output is the checkpoint's dequantized model, which is what
transformers runs where it has no FP8 kernels.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from adaspec.models.registry import read_json

# Per-layer scales of FP8 activations and of an FP8 KV cache: no use to a model that
# computes (and caches) in bf16 / fp32.
_ACTIVATION_SCALES = (".input_scale", ".input_scale_ub", ".k_scale", ".v_scale", ".q_scale", ".prob_scale",
                      ".kv_scale", ".output_scale")
_WEIGHT_SCALES = (".weight_scale_inv", ".weight_scale")
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n))


@dataclass(frozen=True)
class Fp8Checkpoint:
    """An FP8 checkpoint's format: `method` as config.json names it; `block` (rows, cols) of
    one weight scale when scales are per block (None: the scale's shape says per tensor or
    per output channel)."""

    method: str
    block: tuple[int, int] | None = None

    def describe(self) -> str:
        grain = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per tensor/channel scales"
        return f"FP8 checkpoint ({self.method}, {grain})"


def _block(value, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"{where} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _fp8_method(q: dict) -> Fp8Checkpoint:
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"quantization_config.fmt {fmt!r}: only e4m3 and e5m2 FP8 weights are supported")
    return Fp8Checkpoint("fp8", _block(q.get("weight_block_size"), "quantization_config.weight_block_size"))


def _compressed_tensors(q: dict) -> Fp8Checkpoint:
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported: only FP8 weights "
                         f"(format float-quantized or naive-quantized)")
    if q.get("sparsity_config"):
        raise ValueError("compressed-tensors sparsity_config is not supported: only dense FP8 weights")
    blocks = set()
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors config_groups.{name}.weights: {w.get('num_bits')}-bit "
                             f"{w.get('type')} weights are not supported: only 8-bit float (FP8)")
        strategy = w.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors config_groups.{name}.weights.strategy {strategy!r} is not "
                             f"supported: tensor, channel or block")
        if strategy == "block":
            blocks.add(_block(w.get("block_structure"), f"config_groups.{name}.weights.block_structure"))
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors: config groups use different block structures {sorted(blocks)}")
    return Fp8Checkpoint("compressed-tensors", blocks.pop() if blocks else None)


def _fbgemm_fp8(q: dict) -> Fp8Checkpoint:
    return Fp8Checkpoint("fbgemm_fp8")


QUANT_METHODS = {"fp8": _fp8_method, "compressed-tensors": _compressed_tensors, "fbgemm_fp8": _fbgemm_fp8}


def read_quantization(cfg: dict) -> Fp8Checkpoint | None:
    """The checkpoint format config.json declares (None: plain weights). ValueError for a
    quantization method, or a variant of one, that adaspec cannot read."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; adaspec reads FP8 "
                         f"checkpoints ({', '.join(sorted(QUANT_METHODS))}) and unquantized ones")
    return QUANT_METHODS[method](q)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str) -> torch.Tensor:
    """weight [..., N, K] (float8) x scale, in float32. The scale is one number, one per output
    row ([..., N] or [..., N, 1]), or a grid [..., ceil(N/bn), ceil(K/bk)] of `block` (bn, bk)
    tiles (edge tiles partial; without `block`, the grid must divide the weight evenly)."""
    w = weight.float()
    # (uint8 scales are E8M0 exponents stored as bytes: 2 ** (byte - 127))
    s = torch.exp2(scale.float() - 127.0) if scale.dtype == torch.uint8 else scale.float()
    N, K = w.shape[-2:]
    lead = w.shape[:-2]
    if s.numel() == 1:
        return w * s.reshape(())
    if s.shape in (lead + (N,), lead + (N, 1)):
        return w * s.reshape(lead + (N, 1))
    if s.dim() != w.dim() or s.shape[:-2] != lead:
        raise ValueError(f"{name}: scale of shape {tuple(s.shape)} does not fit weight {tuple(w.shape)}")
    sn, sk = s.shape[-2:]
    if block is None:
        if N % sn or K % sk:
            raise ValueError(f"{name}: scale grid {sn}x{sk} does not divide weight {N}x{K} and the config "
                             f"gives no block size")
        block = (N // sn, K // sk)
    bn, bk = block
    if sn != -(-N // bn) or sk != -(-K // bk):
        raise ValueError(f"{name}: scale grid {sn}x{sk} does not tile weight {N}x{K} in {bn}x{bk} blocks")
    s = s.repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]
    return w * s


def dequantize_stream(stream: Iterator[tuple[str, torch.Tensor]], fmt: Fp8Checkpoint,
                      device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with float8 weights dequantized (see the module docstring)."""
    weights: dict[str, torch.Tensor] = {}   # float8 weights whose scale has not come yet
    scales: dict[str, tuple] = {}          # (name, scale) whose weight has not come yet, by weight name
    for name, t in stream:
        if name.endswith(_ACTIVATION_SCALES):
            continue
        scale_of = next((name[: -len(s)] + ".weight" for s in _WEIGHT_SCALES if name.endswith(s)), None)
        if scale_of is not None:
            if scale_of in weights:
                yield scale_of, _deq(weights.pop(scale_of), t, fmt, scale_of, device)
            else:
                scales[scale_of] = (name, t)
        elif t.dtype in _FP8:
            if name in scales:
                yield name, _deq(t, scales.pop(name)[1], fmt, name, device)
            else:
                weights[name] = t
        else:
            yield name, t
    if weights:
        raise ValueError(f"{fmt.describe()}: float8 tensor(s) {sorted(weights)[:4]} have no weight_scale / "
                         f"weight_scale_inv tensor")
    # Scales of weights the checkpoint does not hold: passed on, for the loader to name as unread.
    yield from scales.values()


def _deq(weight, scale, fmt, name, device):
    if device is not None:
        weight, scale = weight.to(device), scale.to(device)
    return dequantize(weight, scale, fmt.block, name)


def check_requested(requested: str | None, model_dir) -> None:
    """vLLM's `quantization` argument: None, or the method the checkpoint in `model_dir`
    declares (adaspec reads checkpoints as published; it does not quantize a model itself).
    ValueError otherwise."""
    if requested is None:
        return
    fmt = read_quantization(read_json(Path(model_dir) / "config.json"))
    if fmt is None or fmt.method != requested:
        have = f"an {fmt.method} checkpoint" if fmt else "an unquantized checkpoint"
        raise ValueError(f"quantization={requested!r}: {model_dir} is {have}; adaspec reads quantized checkpoints "
                         f"as published (their config.json says how) and does not quantize a model when loading "
                         f"it: leave quantization unset")
