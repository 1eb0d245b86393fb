"""The host side of a step's grammar bitmask (`structured.bitmask`), split around the device
half of the step (`ModelRunner.execute_program`).

A node's mask depends on the draft tokens on its path, and the drafts are made on the device
inside the same step. So the mask cannot be staged with the step's inputs: `_prepare` names
the step's grammar rows in a `GrammarStep` (carried by the StepProgram), and the device half
starts copying the drafts to the host right after the drafters were enqueued (`read_drafts`),
lets the target forward run, and fills the masks on the host meanwhile (`masks`); the post-
forward applies them after the penalties (verify_step.PostForward).

The mask is built from the matchers, which live in rank 0's process only, and reaches the
device by a plain copy, not by the staging buffer every rank receives: tensor-parallel
workers would never see it. Grammar requests are therefore refused when
tensor_parallel_size > 1 (`Engine.add_request`, and a 400 in the server).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaspec.structured.bitmask import step_bitmask

TP_UNSUPPORTED = ("structured outputs (a grammar) are not supported with tensor_parallel_size > 1: their "
                  "token masks are built on rank 0 during the step and never reach the other ranks")


@dataclass
class GrammarStep:
    """A step's grammar rows: one `RequestGrammar` or None per verify request, their own draft
    depths (host), and the step's shape. `drafting`: the step makes drafts, whose tokens pick
    each node's grammar state."""

    grammars: list
    limit: np.ndarray
    N: int
    tree: bool
    drafting: bool

    def __getstate__(self):   # never pickled: the program codec would send it to TP workers
        raise TypeError(TP_UNSUPPORTED)


class GrammarMasks:
    """Builds the steps' bitmasks on `device`; owns the pinned landing buffers of the drafts
    (CUDA), reused: allocating pinned memory costs more than the copy, and each step's are
    read within its own launch, before the next step can use them."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: dict = {}

    def read_drafts(self, g: GrammarStep, vb):
        """Start copying the step's drafts (tokens, parents, limits of the VerifyBatch `vb`) to
        the host; (host tensors, the event that says they are there), or None without drafts."""
        if not g.drafting:
            return None
        src = (vb.tokens.t, vb.parents.t, vb.limit.t)
        if self.device.type != "cuda":
            return [t.clone() for t in src], None
        host = []
        for i, t in enumerate(src):
            key = (i, tuple(t.shape), t.dtype)
            if key not in self._host:
                self._host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.append(self._host[key])
        for h, t in zip(host, src):
            h.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    def masks(self, g: GrammarStep, drafts) -> tuple:
        """(bitmask on the device, rows, vocab) of the step's grammar rows: waits for the drafts
        when the step has any."""
        tokens = parents = None
        limit = g.limit
        if drafts is not None:
            host, ev = drafts
            if ev is not None:
                ev.synchronize()
            tokens, parents, limit = (t.numpy() for t in host)
            parents = parents if g.tree else None
        vocab = next(x.vocab_size for x in g.grammars if x is not None)
        mask, rows = step_bitmask(g.grammars, vocab, g.N, tokens, parents, limit)
        return mask.to(self.device), rows, vocab


def grammar_step(grammars: list, limit: np.ndarray, N: int, tree: bool, drafting: bool) -> GrammarStep | None:
    """The step's GrammarStep, None when no verify request has a grammar."""
    if all(g is None for g in grammars):
        return None
    return GrammarStep(grammars, limit, N, tree, drafting)
