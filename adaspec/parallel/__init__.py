"""Tensor parallelism primitives: the process group of one engine (`group`), how a model is cut
into per-rank shards (`shard`) and the layers that need a collective (`layers`).

Policy-free: this floor knows nothing of steps, requests or workers; the engine's
`tp_driver` / `tp_worker` spawn the processes and feed them steps.
"""
from adaspec.parallel.group import TPGroup
from adaspec.parallel.shard import Shard

__all__ = ["TPGroup", "Shard"]
