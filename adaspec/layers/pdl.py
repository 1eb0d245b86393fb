"""Programmatic dependent launch (PDL, Hopper and later) for the fast path's Triton kernels.

A decode step of a small batch is hundreds of short kernels (553 for the Qwen3-30B-A3B shape at
batch 1), each paying its launch and ramp-up before it reads a byte. With PDL a kernel's
programs are launched while the kernel before it in the stream finishes: each one first waits
(`gdc_wait`: every program of the previous kernel has completed and its writes are visible),
then at once lets the next kernel launch (`gdc_launch_dependents`). So a kernel never reads
or writes memory before its predecessor is done, exactly as without PDL; what overlaps is the
launch. CUDA graphs capture the dependency as a programmatic edge.

Contract for a kernel taking part: a `USE_GDC: tl.constexpr = False` parameter, `gdc_enter(USE_GDC)`
as its first statement, and its launch splats `launch_kw(tensor)`. Kernels launched without PDL (cuBLAS, torch's) are
serialized as always; a PDL kernel after one of them waits for its completion the same way.
ADASPEC_PDL=0 turns it off (the A/B of benchmarks/gpu_fast_path.py runs).
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    """Compute capability 9+, and a Triton whose launcher takes `launch_pdl`."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) \
        and torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether launches over tensors on `t`'s device use PDL: a CUDA device of compute
    capability 9 or more, not the Triton interpreter, not turned off by ADASPEC_PDL=0."""
    if t.device.type != "cuda" or os.environ.get("ADASPEC_PDL", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


if os.environ.get("ADASPEC_TRITON_INTERPRET") == "1":   # as fused_ops: Triton reads it at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton
    import triton.language as tl
except ImportError:   # no Triton: nothing launches with PDL (`enabled` is False off CUDA)
    triton = None

if triton is not None:

    @triton.jit
    def gdc_enter(USE_GDC: tl.constexpr):
        """A PDL kernel's first statement: wait for the previous kernel, then let the next launch."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


def launch_kw(t: torch.Tensor) -> dict:
    """The launch keywords of a PDL-aware kernel (see the module docstring) for `t`'s device."""
    return {"USE_GDC": True, "launch_pdl": True} if enabled(t) else {}
