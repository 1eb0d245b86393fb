"""The engine's objects and Python's cyclic garbage collector.

A full (generation 2) collection walks every tracked object of the process. After start-up
that is the model's modules, tensors, compiled kernels, CUDA graphs and the tokenizer: a few
hundred thousand objects that live as long as the engine, walked again each time the objects
a step allocates (requests, token lists, logprob entries) push the collector into a full pass.
Measured on CPU with the demo pair: one full collection cost 0.19 s among ~350k objects, and
logprobs on every request made such a pass happen within a 15 s run; on the device such a pause
stalls every request in flight. So the engine moves what exists once it has started into the
collector's permanent generation (`gc.freeze`, as vLLM does after start-up): later passes walk
only what came after.

Frozen objects are never collected as cyclic garbage. The heap is thawed when an engine is
built (the garbage of engines before it, their CUDA graphs included, can go in the collection
that precedes graph capture) and when one is closed.
"""
from __future__ import annotations

import gc


def thaw() -> None:
    """Return frozen objects to the collector (before building an engine, and at close)."""
    gc.unfreeze()


def freeze() -> None:
    """Collect, then freeze every object that survives (the engine just started)."""
    gc.collect()
    gc.freeze()
