"""Weights from a local Hugging Face directory, or random.

Formats: safetensors (`model.safetensors`, or shards listed in `model.safetensors.index.json`)
and PyTorch pickles (`pytorch_model.bin`, or shards listed in `pytorch_model.bin.index.json`),
the latter read with `torch.load(weights_only=True)` so a checkpoint cannot run code. When a
directory holds both, safetensors wins (as in transformers).

Contract: every parameter of the module is filled from the checkpoint (or, with
`load_format="dummy"`, from a seeded normal distribution); a missing tensor or a shape
mismatch raises ValueError naming it. Extra tensors in a *target* checkpoint are ignored
(rotary caches and the like); the EAGLE-3 loader accounts for every tensor of a head itself.
FP8 checkpoints are dequantized to the model's dtype as they are read (models/quantized.py).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from adaspec.models.quantized import Fp8Checkpoint, dequantize_stream, read_quantization
from adaspec.models.registry import parse_model_spec, read_json

logger = logging.getLogger("adaspec")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; use one of auto, float32, float16, bfloat16")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return DTYPES.get(checkpoint_dtype or "bfloat16", torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16


# load_format -> the weight files it reads: (index file, file glob) in order of preference.
WEIGHT_FILES = {
    "auto": (("model.safetensors.index.json", "*.safetensors"), ("pytorch_model.bin.index.json", "pytorch_model*.bin")),
    "safetensors": (("model.safetensors.index.json", "*.safetensors"),),
    "pt": (("pytorch_model.bin.index.json", "pytorch_model*.bin"),),
}


def checkpoint_files(model_dir: Path, load_format: str = "auto") -> list[Path]:
    """The weight files of `model_dir` that `load_format` reads (vLLM's names: auto prefers
    safetensors, safetensors / pt read only those), in a stable order: an index's shards, else
    the directory's files. Raises FileNotFoundError."""
    kinds = WEIGHT_FILES[load_format]
    for index_name, _ in kinds:
        index = model_dir / index_name
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [model_dir / f for f in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise FileNotFoundError(f"{index} lists shard(s) {missing[:4]} that are not in {model_dir}")
            return files
    for _, pattern in kinds:
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    wanted = " or ".join(p for _, p in kinds)
    raise FileNotFoundError(f"no weights in {model_dir}: expected {wanted} (load_format {load_format!r}; "
                            f"or pass load_format='dummy' to run with random weights)")


def iter_tensors(model_dir: Path, part: Callable[[str], tuple[int, int, int] | None] | None = None,
                 load_format: str = "auto", skip: Callable[[str], bool] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, one file at a time, on the CPU.
    `part(name)` = (dim, start, stop): only that slice of the tensor is read (tensor
    parallelism: a rank reads its shard; safetensors reads just those bytes). `skip(name)`:
    the tensor is not read at all (expert parallelism: another rank holds it)."""
    from safetensors import safe_open

    for f in checkpoint_files(model_dir, load_format):
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if skip is not None and skip(name):
                        continue
                    p = part(name) if part is not None else None
                    if p is None:
                        yield name, sf.get_tensor(name)
                        continue
                    sl = sf.get_slice(name)
                    idx = tuple(slice(p[1], p[2]) if d == p[0] else slice(None) for d in range(len(sl.get_shape())))
                    yield name, sl[idx]
            continue
        try:
            # weights_only: tensors and plain containers only, never arbitrary pickled code;
            # mmap keeps a multi-GB shard out of RAM until each tensor is copied.
            state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means the same to the user
            raise ValueError(f"cannot read {f} as a PyTorch state dict with weights_only=True: {e}") from None
        if not isinstance(state, dict):
            raise ValueError(f"{f} holds a {type(state).__name__}, expected a dict of tensors (a state dict)")
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{f}: entry {name!r} is a {type(t).__name__}, not a tensor")
            if skip is None or not skip(name):
                yield name, _cut(part, name, t).contiguous() if part is not None else t
        del state


def checkpoint_tensors(model_dir: Path, part: Callable[[str], tuple[int, int, int] | None] | None = None,
                       quant: Fp8Checkpoint | None = None, device: torch.device | None = None,
                       load_format: str = "auto", fused=None, skip: Callable[[str], bool] | None = None,
                       split: Callable | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_tensors`, with an FP8 checkpoint's weights dequantized (on `device`) and, with
    `fused` (the whole model's ModelSpec), fused projections split (`split_fused`). A rank's
    slice (`part`) of such a tensor is cut after both: one block scale, or one fused tensor,
    covers rows of several ranks' parameters. `split(name, tensor)`: the model's own rewrite of
    a tensor into the ones it stands for (`_split_stream`), or None to keep it."""
    if quant is None and fused is None:
        stream = iter_tensors(model_dir, part, load_format, skip)
        yield from _split_stream(stream, split, part, skip) if split is not None else stream
        return
    stream = iter_tensors(model_dir, load_format=load_format, skip=skip)
    if quant is not None:
        stream = dequantize_stream(stream, quant, device)
    if fused is not None:
        stream = split_fused(stream, fused)
    if split is not None:
        stream = _split_stream(stream, split, None, skip)
    for name, t in stream:
        yield name, _cut(part, name, t)


def _split_stream(stream, split: Callable, part, skip) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `split` rewrites (MoE experts stacked in one tensor: each expert's own), each
    piece then skipped or cut as this rank reads it (the whole was read: its name says neither);
    the other tensors as they come."""
    for name, t in stream:
        pieces = split(name, t)
        if pieces is None:
            yield name, t
            continue
        for n, x in pieces:
            if skip is None or not skip(n):
                yield n, _cut(part, n, x)


def _cut(part, name: str, t: torch.Tensor) -> torch.Tensor:
    """`part(name)`'s slice of a tensor already read whole (all of it without one)."""
    p = part(name) if part is not None else None
    return t if p is None else t.narrow(p[0], p[1], p[2] - p[1])


def split_fused(stream: Iterator[tuple[str, torch.Tensor]], spec) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's fused projections (Phi-3: `qkv_proj` = q rows, k rows, v rows;
    `gate_up_proj` = gate rows, up rows) as the separate tensors the model reads, by the whole
    model's `spec` (a ModelSpec)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for name, t in stream:
        if name.endswith(".qkv_proj.weight"):
            pre = name[: -len("qkv_proj.weight")]
            if t.shape[0] != q + 2 * kv:
                raise ValueError(f"{name} has {t.shape[0]} rows; the config's heads make {q + 2 * kv}")
            yield from ((pre + p, w) for p, w in zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"),
                                                    t.split([q, kv, kv])))
        elif name.endswith(".gate_up_proj.weight") and ".experts." not in name:
            pre = name[: -len("gate_up_proj.weight")]
            if t.shape[0] != 2 * spec.intermediate_size:
                raise ValueError(f"{name} has {t.shape[0]} rows; the config's intermediate_size makes "
                                 f"{2 * spec.intermediate_size}")
            yield pre + "gate_proj.weight", t[: spec.intermediate_size]
            yield pre + "up_proj.weight", t[spec.intermediate_size:]
        else:
            yield name, t


def load_state(module: nn.Module, model_dir: Path, checkpoint_name: Callable[[str], str],
               optional: Callable[[str], bool] = lambda n: False,
               tensors: dict[str, torch.Tensor] | None = None,
               checkpoint_parts: Callable[[str], list[tuple[str, tuple]] | None] | None = None,
               part: Callable[[str], tuple[int, int, int] | None] | None = None,
               check_unread: bool = True, quant: Fp8Checkpoint | None = None, load_format: str = "auto",
               fused=None, skip: Callable[[str], bool] | None = None, split: Callable | None = None) -> set[str]:
    """Copy checkpoint tensors (read from `model_dir`, or given as `tensors`) into `module`'s
    parameters; returns the names of the parameters left unfilled (only those `optional`
    allows). Raises ValueError on missing or misshapen.

    `checkpoint_parts(param)` may say a parameter is assembled from several checkpoint tensors,
    as [(checkpoint name, index into the parameter)] (MoE experts stacked into [E, ...] from
    per-expert tensors, which may sit in different shards); None: the one `checkpoint_name`.
    `part(checkpoint name)`: the slice of it to read (see `iter_tensors`); a slice shorter than
    the parameter (the last vocabulary shard) fills its first rows, the rest is zeroed.
    `check_unread`: checkpoint tensors no parameter reads are checked (`_check_unread`);
    off for callers that account for them themselves (EAGLE-3 heads). `quant`: the FP8 format
    of the checkpoint in `model_dir` (`checkpoint_tensors`); `load_format` which of its files
    are read (`checkpoint_files`); `fused`: the whole model's ModelSpec when the checkpoint
    fuses projections (`split_fused`); `skip(name)`: a tensor this rank does not read at all
    (`iter_tensors`); `split`: the model's rewrite of tensors it reads in pieces (`_split_stream`)."""
    params = dict(module.named_parameters(remove_duplicate=True))
    wanted: dict[str, tuple[str, tuple | None]] = {}
    needs: dict[str, list[str]] = {}
    for n in params:
        parts = checkpoint_parts(n) if checkpoint_parts is not None else None
        parts = parts if parts is not None else [(checkpoint_name(n), None)]
        needs[n] = [c for c, _ in parts]
        wanted.update((c, (n, idx)) for c, idx in parts)
    got: set[str] = set()
    unread: list[str] = []
    device = next(iter(params.values())).device if params else None
    source = tensors.items() if tensors is not None else checkpoint_tensors(model_dir, part, quant, device,
                                                                              load_format, fused, skip, split)
    for name, tensor in source:
        hit = wanted.get(name)
        if hit is None:
            unread.append(name)
            continue
        pname, idx = hit
        p = params[pname]
        dst = p if idx is None else p[idx]
        cut = part(name) if part is not None else None
        if cut is not None and tensor.shape[cut[0]] < dst.shape[cut[0]]:   # a padded shard
            with torch.no_grad():
                dst.zero_()
            dst = dst.narrow(cut[0], 0, tensor.shape[cut[0]])
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"tensor {name!r} in {model_dir} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor.to(p.dtype))
        got.add(name)
    if check_unread:
        # (a tied LM head's own copy in the checkpoint is expected: the embedding serves as both)
        tied = {checkpoint_name(n) for n, _ in module.named_parameters(remove_duplicate=False)} - set(wanted)
        _check_unread(model_dir, [n for n in unread if n not in tied], wanted)
    unfilled = {n for n in params if any(c not in got for c in needs[n])}
    missing = [c for n in params if n in unfilled and not optional(n) for c in needs[n] if c not in got]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensor(s) {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return unfilled


# Tensors a checkpoint may hold that no model reads: rotary tables some exports keep.
_HARMLESS = ("rotary_emb.inv_freq",)


def _check_unread(model_dir: Path, unread: list[str], wanted: dict) -> None:
    """A checkpoint bias the model has no place for (its weight is read) means the config
    and the checkpoint disagree: reading on without it would silently change the output, so
    it is an error. Other tensors nothing reads (e.g. multi-token-prediction layers) are
    named in a warning."""
    biases = [n for n in unread if n.endswith(".bias") and n[:-len("bias")] + "weight" in wanted]
    if biases:
        raise ValueError(f"checkpoint {model_dir} has bias tensor(s) {biases[:4]} that the model built from its "
                         f"config.json has no place for (a config flag such as attention_bias / mlp_bias "
                         f"disagrees with the weights)")
    other = [n for n in unread if not n.endswith(_HARMLESS)]
    if other:
        logger.warning("checkpoint %s: %d tensor(s) not read (e.g. %s)", model_dir, len(other), ", ".join(other[:4]))


def init_dummy(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights of the right shapes: normal(0, std) matrices, unit norms, zero biases.
    Drawn on the parameters' own device (an 8B model in seconds on a GPU)."""
    gens: dict = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                g = gens.get(p.device)
                if g is None:
                    g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
                p.normal_(0.0, std, generator=g)


def load_model(model_dir: str | Path, device: torch.device, dtype: str = "auto",
               load_format: str = "auto", seed: int = 0, shard=None):
    """Build the target model on `device` and fill its weights. Returns (model, spec, torch dtype).
    With `shard` (adaspec.parallel.Shard): this rank's part of the model, built at its local
    sizes (`shard.local_spec`) from only its slices of the checkpoint; `spec` stays the full
    model's (dummy weights: the same seeded draws on every rank, so replicated parameters agree)."""
    model_dir = Path(model_dir)
    spec, klass = parse_model_spec(model_dir)
    tdtype = resolve_dtype(dtype, spec.torch_dtype, device)
    local = shard.local_spec(spec) if shard is not None else spec
    with torch.device("meta"):
        model = klass(local)
    model = model.to_empty(device=device).to(tdtype)
    for m in model.modules():  # e.g. GLM's router: Hugging Face keeps it in fp32 whatever the dtype
        if getattr(m, "keep_fp32", False):
            m.float()
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if load_format == "dummy":
        init_dummy(model, seed)
    elif load_format in WEIGHT_FILES:
        quant = read_quantization(read_json(model_dir / "config.json"))
        if quant is not None:
            logger.info("%s: weights dequantized to %s as they load", quant.describe(), str(tdtype).removeprefix("torch."))
        load_state(model, model_dir, model.checkpoint_name, quant=quant, load_format=load_format,
                   fused=spec if spec.fused_checkpoint else None,
                   checkpoint_parts=getattr(model, "checkpoint_parts", None),
                   part=(lambda name: shard.slice_of(name, spec)) if shard is not None else None,
                   skip=(lambda name: not shard.holds(name, spec)) if shard is not None else None,
                   split=getattr(model, "split_checkpoint_tensor", None))
    else:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {sorted(WEIGHT_FILES) + ['dummy']}")
    return model.eval(), spec, tdtype

