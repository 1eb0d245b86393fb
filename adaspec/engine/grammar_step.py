"""The host side of a step's grammar bitmask (`structured.bitmask`), split around the device
half of the step (`ModelRunner.execute_program`).

A node's mask depends on the draft tokens on its path, and the drafts are made on the device
inside the same step; its root's mask depends on the tokens the step before emitted, which
the host learns only when it reads that step back. So the mask cannot be staged with the
step's inputs. A grammar step is launched in two halves instead: the first (`launch`) queues
the drafters, starts copying the drafts to the host (`read_drafts`) and queues the target
forward; the engine then reads the previous step back (its tokens advance the matchers), and
the second half (`ModelRunner.finish`) fills the mask on the host (`masks`) while the forward
runs, copies it into a device buffer of fixed address, and queues the post-forward, which
applies it after the penalties (verify_step.PostForward; a post CUDA graph reads the same
buffer). So grammar steps are planned ahead like every other step.

The mask is built from the matchers, which live in rank 0's process only, and reaches the
device by a plain copy, not by the staging buffer every rank receives: tensor-parallel
workers would never see it. Grammar requests are therefore refused when
tensor_parallel_size > 1 (`Engine.add_request`, and a 400 in the server).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import torch

from adaspec.structured.bitmask import bitmask_width, step_bitmask

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
    """The steps' bitmasks: a device buffer of `rows` x `width` words at a fixed address (the
    post graphs capture it) and its pinned host twin (CUDA), plus the pinned landing buffers of
    the drafts. Each is reused step after step: a step's second half writes them only after
    the engine has read the step before back, so that step's copies are done."""

    def __init__(self, device: torch.device, rows: int, vocab_size: int):
        self.device, self.vocab_size = device, vocab_size
        self.width = bitmask_width(vocab_size)
        self.dev = torch.full((rows, self.width), -1, dtype=torch.int32, device=device)
        self._mask_host = None
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

    def masks(self, g: GrammarStep, drafts, legal_into: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """(the device bitmask of the step's logits rows, vocab): every verify request's N rows
        (a graph batch's padding requests' too, allowing everything); waits for the drafts when
        the step has any. `legal_into` (simulated acceptance): the step's draft tokens
        on the device, which get the drafts with each forbidden one replaced by a legal one
        (`step_bitmask`'s legalize), so simulated acceptance does not depend on whether a
        random head's tokens happen to be legal."""
        tokens = parents = None
        limit = g.limit
        if drafts is not None:
            host, ev = drafts
            if ev is not None:
                ev.synchronize()
            tokens, parents, limit = (t.numpy() for t in host)
            parents = parents if g.tree else None
        vocab = next(x.vocab_size for x in g.grammars if x is not None)
        if bitmask_width(vocab) != self.width:
            raise ValueError(f"a grammar over {vocab} tokens on a model of {self.vocab_size}")
        num_rows = len(g.limit) * g.N
        host = self._host_rows(num_rows)
        if step_bitmask(host, g.grammars, g.N, tokens, parents, limit, legal_into is not None and tokens is not None):
            legal_into.copy_(drafts[0][0], non_blocking=True)   # (the pinned tokens `tokens` views)
        dev = self.dev[:num_rows]
        dev.copy_(host, non_blocking=True)
        return dev, vocab

    def _host_rows(self, n: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.empty(n, self.width, dtype=torch.int32)
        if self._mask_host is None:   # pinned once, at the first grammar step
            self._mask_host = torch.empty(self.dev.shape, dtype=torch.int32, pin_memory=True)
        return self._mask_host[:n]


def grammar_available() -> bool:
    """Whether xgrammar is installed (the post graphs with a bitmask are captured only then)."""
    return importlib.util.find_spec("xgrammar") is not None


def grammar_step(grammars: list, limit: np.ndarray, N: int, tree: bool, drafting: bool) -> GrammarStep | None:
    """The step's GrammarStep, None when no verify request has a grammar."""
    if all(g is None for g in grammars):
        return None
    return GrammarStep(grammars, limit, N, tree, drafting)
