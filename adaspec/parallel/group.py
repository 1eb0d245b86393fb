"""The process group of one tensor-parallel engine: rank 0 is the engine's own process (it
plans every step), ranks 1..N-1 are its workers. NCCL on CUDA, gloo on CPU (so the same code
runs in CI). One engine's world at a time per process: it is torch.distributed's default group.

Collectives used by the model (`all_reduce`, `all_gather_last`) are plain torch.distributed
calls on the current stream, so they are captured inside CUDA graphs as they are (NCCL is
capturable). NVLink multicast (NVLS, symmetric-memory multicast) stays off in every process.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Never NVLink SHARP / multicast objects: on the lent machines they are not to be created.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def disable_multicast() -> None:
    """Set the no-multicast environment (before NCCL initialises in this process)."""
    for k, v in NO_MULTICAST_ENV.items():
        os.environ[k] = v


def collective_timeout_s() -> float:
    """How long a collective may wait for a peer before it fails (ADASPEC_TP_TIMEOUT_S, default
    600 s: ranks load weights and compile kernels at different speeds). A dead or frozen
    peer is caught in seconds by the driver's monitor (`tp_driver`), not by this."""
    return float(os.environ.get("ADASPEC_TP_TIMEOUT_S", "600"))


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r (one host), or the CPU."""
    return torch.device("cuda", rank) if base.type == "cuda" else base


# torch >= 2.13 renamed all_gather_into_tensor (same contract)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TPGroup:
    """This process's place in the engine's tensor-parallel world."""

    rank: int
    size: int
    device: torch.device

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @classmethod
    def init(cls, rank: int, size: int, device: torch.device, init_method: str) -> "TPGroup":
        """Join the world (blocks until every rank has joined, up to the collective timeout)."""
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size > 1 needs a process without a torch.distributed world "
                               "(one tensor-parallel engine per process at a time)")
        disable_multicast()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        g = cls(rank, size, device)
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(g.backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s()), **kw)
        return g

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- collectives of the model (capturable) ------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns x."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank r's part at columns r*n .. (r+1)*n. Every
        rank gets the same bytes (the parts are copied, not recomputed)."""
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather(out, x)   # rank parts stacked along dim 0 (gloo's layout too)
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    # ---- control (start-up, step broadcast) ---------------------------------------------
    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's x into every rank's x (in place)."""
        dist.broadcast(x, src=0)

    def exchange(self, value=None, error: str | None = None) -> list:
        """Start-up exchange: every rank's `value`, in rank order, or TPStartupError on every
        rank naming the ranks that passed an `error`. The ONLY start-up collective, so a rank
        that failed and ranks still working always meet in the same call: a rank that raised
        from here (or failed before its own call) exchanges nothing more."""
        got: list = [None] * self.size
        dist.all_gather_object(got, (error, value))
        bad = [(r, e) for r, (e, _) in enumerate(got) if e is not None]
        if bad:
            raise TPStartupError("; ".join(f"tensor-parallel rank {r}: {e}" for r, e in bad))
        return [v for _, v in got]


class TPStartupError(RuntimeError):
    """A start-up phase failed on one or more ranks (the message names them)."""
