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

PDL is not free on the host: a CUDA graph with programmatic edges takes about twice the host
time to launch (H200, the demo pair's graphs at batch 1: 41-49 us against 21-36 us a replay,
benchmarks/launch_anatomy.py). Where the device waits for the host anyway (a small model, whose
step is mostly launch work) that is pure loss; where the host waits for the device (an 8B
model: a batch-1 decode step 4.48 -> 4.30 ms with PDL) it pays. So the engine chooses per
model (`choose`: by the bytes of weights one step reads on this GPU). ADASPEC_PDL=0 / =1 forces
it off / on (the A/B of benchmarks/gpu_fast_path.py runs).
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


# A model whose weights on one GPU take at least this many bytes reads them for about a
# millisecond or more per decode step (H200: 4.8 TB/s), more than a step's host work at batch 1
# (0.5-2 ms on the device's host): the device sets the pace, and PDL's overlap pays.
DEVICE_BOUND_BYTES = 4 << 30

_chosen: bool | None = None   # the engine's choice (`choose`); None: none made (kernel tests: on)


def forced() -> bool | None:
    """ADASPEC_PDL=0 / =1: off / on whatever the model; None when unset (the engine chooses)."""
    v = os.environ.get("ADASPEC_PDL")
    return None if v is None else v != "0"


def choose(weight_bytes: int) -> bool:
    """Choose PDL for this process's launches from the bytes of target weights one GPU reads per
    step (the engine calls it once its model is loaded, before any graph is captured):
    on for a device-bound model (>= DEVICE_BOUND_BYTES), off for a host-bound one; ADASPEC_PDL
    overrides. Returns the choice (whether it takes effect still depends on the GPU, `enabled`).
    Launches of any mix are correct: a kernel built for PDL but launched without it waits for
    nothing it would not have waited for anyway."""
    global _chosen
    f = forced()
    _chosen = f if f is not None else weight_bytes >= DEVICE_BOUND_BYTES
    return _chosen


def enabled(t: torch.Tensor) -> bool:
    """Whether launches over tensors on `t`'s device use PDL: a CUDA device of compute
    capability 9 or more, not the Triton interpreter, chosen for the model (`choose`) or forced
    by ADASPEC_PDL."""
    if t.device.type != "cuda":
        return False
    f = forced()
    if f is False or (f is None and _chosen is False):
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
