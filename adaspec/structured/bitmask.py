"""A step's token bitmask: one row per logits row of the verify batch (request k's node j at
row k*N + j), bit t of a row set when token t is allowed there.

Node j's mask is the grammar's state after the request's emitted tokens AND the draft tokens
on the path from the root to j (a chain: drafts 1..j; a tree: the node's ancestors). With
the target's choice at every node drawn from its masked logits, verification stays exactly
what it is without a grammar: a draft token the grammar forbids never equals the choice at
its parent, so it is rejected; the bonus token is drawn under its node's mask; and the
matcher itself only ever advances by emitted tokens, so nothing needs to be rolled back.
Nodes a walk cannot reach (under a forbidden draft, padding, beyond the request's own depth)
allow every token: their choice is never used, and an all-masked row would be NaN once
softmaxed.

Host work per grammar request: one xgrammar call (`traverse_draft_tree`, C++) per step.
"""
from __future__ import annotations

import functools

import numpy as np
import torch


def _tree_links(parents: np.ndarray, limit: int) -> tuple[list[int], list[int]]:
    """(first child, next sibling) of each node (-1: none) from `parents` (-1: root or
    unconnected), keeping nodes up to depth `limit`."""
    n = len(parents)
    first, sib, last = [-1] * n, [-1] * n, [-1] * n
    depth = [0] * n
    for i in range(1, n):
        p = int(parents[i])
        if p < 0 or depth[p] >= limit:
            continue
        depth[i] = depth[p] + 1
        if first[p] < 0:
            first[p] = i
        else:
            sib[last[p]] = i
        last[p] = i
    return first, sib


@functools.lru_cache(maxsize=256)
def _chain_links(n: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_tree_links` of a chain of n nodes cut at `depth` (the same few shapes every step)."""
    first, sib = _tree_links(np.arange(-1, n - 1), depth)
    return torch.tensor(first, dtype=torch.int64), torch.tensor(sib, dtype=torch.int64)


def step_bitmask(grammars: list, vocab_size: int, N: int, tokens: np.ndarray | None, parents: np.ndarray | None,
                 limit: np.ndarray) -> tuple[torch.Tensor, list[int]] | None:
    """(bitmask [B*N, W] int32 on the host, the logits rows it constrains) for B verify
    requests over a vocabulary of `vocab_size` (the grammar's), `grammars[k]` a `RequestGrammar` or None (unconstrained rows allow everything).
    `tokens` [B, N] are the draft tokens (None: no drafts this step), `parents` [B, N] their
    tree (None: chains), `limit` [B] each request's own depth. None when no row is constrained."""
    import xgrammar as xgr

    active = [k for k, g in enumerate(grammars) if g is not None]
    if not active:
        return None
    mask = xgr.allocate_token_bitmask(len(grammars) * N, vocab_size)   # every bit set
    rows: list[int] = []
    for k in active:
        m = grammars[k].matcher
        depth = int(limit[k]) if tokens is not None else 0
        if depth <= 0:
            m.fill_next_token_bitmask(mask, k * N)
            rows.append(k * N)
            continue
        if parents is None:
            first, sib = _chain_links(N, depth)
        else:
            first, sib = (torch.tensor(x, dtype=torch.int64) for x in _tree_links(parents[k], depth))
        view = mask[k * N:(k + 1) * N]
        m.traverse_draft_tree(first, sib, torch.from_numpy(np.ascontiguousarray(tokens[k], dtype=np.int64)), view)
        rows.extend(range(k * N, (k + 1) * N))
    # Unreached draft nodes (all bits clear) allow everything: see the module docstring. A root
    # row stays as it is: all clear there means the grammar cannot go on in this vocabulary,
    # and the request ends with an error when its token is not accepted.
    dead = (mask == 0).all(dim=1)
    dead[::N] = False
    mask[dead] = -1
    return mask, rows


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Disallowed tokens of the constrained `rows` of `logits` [R, V] become -inf, in place
    (xgrammar's kernel for the device: CUDA/Triton on a GPU, C++ on the CPU)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True),
                                    vocab_size=min(vocab_size, logits.shape[-1]), indices=rows)


def legal_drafts(mask: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
    """[B, N] bool: whether node j's token is allowed by its parent's mask (`mask` [B*N, W] on
    the device; chains when `parents` is None). For simulated acceptance (benchmarks) only."""
    B, N = tokens.shape
    m = mask.view(B, N, -1)
    par = parents if parents is not None else torch.arange(-1, N - 1, device=tokens.device).expand(B, N)
    rows = m.gather(1, par.clamp(min=0).unsqueeze(-1).expand(B, N, m.shape[-1]))   # each node's parent's mask
    words = rows.gather(2, (tokens // 32).clamp(max=m.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return ((words >> (tokens % 32)) & 1).bool()
