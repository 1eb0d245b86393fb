"""Simulated acceptance, for benchmarks only: NOT lossless. Each draft is accepted with a
fixed probability whose draws (`accept` [B, >= D] bool, compared with the rate by the caller)
come from the engine's benchmark stream, so the cost side of speculation (every forward, the
draft, verification) is real while acceptance does not depend on random weights. The
emitted tokens are the drafts along the path, then the target's choice as the bonus; same
outputs as `verifier.verify`.
"""
from __future__ import annotations

import numpy as np
import torch

from adaspec.spec_decode.verifier import chain_path, walk


def simulate(tokens: torch.Tensor, parents: torch.Tensor | None, limit: torch.Tensor, choice: torch.Tensor,
             accept: torch.Tensor, depth: int, legal: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept the best (first) child at depth d when accept[:, d-1]; `parents` None = chains.
    `legal` [B, N] bool (grammar requests): a node whose token its parent's grammar mask
    forbids is never accepted, so simulated output still follows each request's grammar. (The
    host has already replaced the forbidden drafts on the path this takes by legal tokens,
    `structured.bitmask.step_bitmask`'s legalize, so acceptance does not depend on a random
    head's tokens; `legal` still guards what that walk could not replace.)"""
    if parents is None:
        ok = accept[:, : tokens.shape[1] - 1]
        path, acc = chain_path(ok & legal[:, 1:] if legal is not None else ok, limit)
    else:
        def pick(cur, d, children):
            first = torch.where(children.any(1), children.int().argmax(1), torch.full_like(cur, -1))
            ok = accept[:, d - 1] if legal is None else accept[:, d - 1] & legal.gather(1, first.clamp(min=0)[:, None])[:, 0]
            return torch.where(ok, first, torch.full_like(cur, -1))

        path, acc = walk(parents, limit, depth, pick)
    # The drafts along the path (node d's token in column d-1), then the bonus after the last.
    emitted = tokens.gather(1, torch.cat([path[:, 1:], path[:, :1]], dim=1))
    bonus = choice.gather(1, path.gather(1, acc.unsqueeze(1)))
    emitted.scatter_(1, acc.unsqueeze(1), bonus)
    return path, emitted, acc + 1


def simulated_draws(rng: np.random.Generator, B: int, pad: int, N: int, rate: float | None) -> np.ndarray | None:
    """Whether each draft of B requests (N - 1 per request) is accepted, with probability
    `rate`; `pad` padding rows draw nothing, so padding never changes a later step's draws.
    None when acceptance is not simulated."""
    if rate is None:
        return None
    acc = rng.random((B, max(1, N - 1))) < rate
    return np.concatenate([acc, np.zeros((pad, acc.shape[1]), dtype=bool)]) if pad else acc
