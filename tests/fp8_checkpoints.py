"""FP8 checkpoints written from a transformers checkpoint as the published formats lay them out
(`write_fp8`), for the FP8 loading tests (tests/models, tests/gpu)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0


def quantizable(name: str, w: torch.Tensor) -> bool:
    """The projections FP8 checkpoints quantize: every Linear of the layers except the router."""
    return (w.dim() == 2 and name.startswith("model.layers.") and name.endswith(".weight")
            and "norm" not in name and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")))


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Powers of two: weight x scale is then exact in bf16 too, so transformers' bf16
    dequantization and adaspec's fp32 one hold the same numbers."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-12) / FP8_MAX)))


def quantize(w: torch.Tensor, grain) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, scale, the scale of every element): grain "tensor", "channel" or a
    (bn, bk) block (edge blocks partial)."""
    if grain == "tensor":
        s = pow2_scale(w.abs().max())
        full = s
    elif grain == "channel":
        s = pow2_scale(w.abs().amax(1, keepdim=True))
        full = s
    else:
        bn, bk = grain
        N, K = w.shape
        s = torch.empty(math.ceil(N / bn), math.ceil(K / bk))
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                s[i, j] = pow2_scale(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max())
        full = s.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return (w / full).to(torch.float8_e4m3fn), s, full


FORMATS = {
    # name -> (quantization_config, grain, scale tensor suffix, extra per-layer tensors)
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [32, 16]}, (32, 16), "weight_scale_inv", False),
    "fp8_tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor", "weight_scale", True),
    "ct_channel": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
                   "channel", "weight_scale", False),
    "ct_tensor_static": ({"quant_method": "compressed-tensors", "format": "naive-quantized",
                          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                              "num_bits": 8, "type": "float", "strategy": "tensor"},
                              "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                    "dynamic": False}}},
                          "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
                         "tensor", "weight_scale", True),
    "ct_block": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [24, 40]}}}},
                 (24, 40), "weight_scale", False),
    "fbgemm": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head"]}, "channel", "weight_scale", False),
}


def write_fp8(src: Path, dst: Path, fmt: str, *, split_scales: bool = False) -> Path:
    """`src` (a transformers checkpoint) written as the FP8 checkpoint `fmt` in `dst`; and the
    model it stands for (float32 weights = float8 x scale, no quantization) in `dst`_ref.
    `split_scales`: the scales in a first shard, the weights in a second (index file)."""
    qcfg, grain, suffix, static = FORMATS[fmt]
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    out, ref, scales = {}, {}, {}
    for name, w in sd.items():
        if not quantizable(name, w):
            out[name] = ref[name] = w
            continue
        q, s, full = quantize(w.float(), grain)
        out[name] = q
        scales[name[: -len("weight")] + suffix] = s
        ref[name] = q.float() * full
        if static:   # activation and KV-cache scales of static FP8 checkpoints: not for a bf16 model
            scales[name[: -len("weight")] + "input_scale"] = torch.tensor([0.02])
            if name.endswith("k_proj.weight"):
                scales[name[: -len("k_proj.weight")] + "k_scale"] = torch.tensor(0.1)
    for d, tensors, q in ((dst, {**out, **scales}, qcfg), (Path(f"{dst}_ref"), ref, None)):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop("quantization_config", None)
        if q is not None:
            cfg["quantization_config"] = q
        (d / "config.json").write_text(json.dumps(cfg))
        if split_scales and q is not None:
            files = {"a.safetensors": {n: t for n, t in tensors.items() if n in scales},
                     "b.safetensors": {n: t for n, t in tensors.items() if n not in scales}}
            for fname, part in files.items():
                save_file(part, str(d / fname), metadata={"format": "pt"})
            weight_map = {n: fname for fname, part in files.items() for n in part}
            (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        else:
            save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return dst
