"""Verification of draft trees (chains are trees with one child per node): ONE pure function,
`verify`, on device tensors; no engine state, no host sync.

Inputs describe B requests with N nodes each (node 0 = the root, the last emitted token;
parents precede children; siblings best-first), padded to a common N:
    tokens  [B, N] int64   target-vocabulary ids (tokens[:, 0] = root)
    parents [B, N] int64   parent node (-1 for the root and for padding nodes)
    limit   [B]    int64   most draft tokens a request may accept (its own depth; 0 = none)
    choice  [B, N] int64   the target's token after each node: the argmax for greedy rows, an
                           exact sample of the row's law for sampled rows (`sampling.choose`)
Outputs:
    path    [B, D+1] int64 node accepted at each depth (path[:, 0] = 0; past the end: 0)
    emitted [B, D+1] int64 emitted tokens: accepted drafts, then the bonus token
    count   [B]      int64 tokens emitted (accepted + 1)

The rule is one for greedy and sampled rows: from the root, follow the child whose token is
the target's choice at the current node; the choice at the last accepted node is the bonus.
For sampled rows this is lossless: EAGLE drafts are deterministic (q is one-hot), and a child
x is accepted with probability p(x) (the draw equals x), a later sibling y with p(y); when
no child matches, the draw is an exact sample of p restricted to the other tokens, which is
the residual of rejection sampling. So every emitted token follows the target's law. Drawing
a token without speculation is verifying zero drafts (N = 1).

Simulated acceptance (benchmarks only, NOT lossless) lives in `spec_decode.simulated`.
"""
from __future__ import annotations

import torch


def walk(parents: torch.Tensor, limit: torch.Tensor, depth: int, pick) -> tuple[torch.Tensor, torch.Tensor]:
    """Follow accepted children from the root. `pick(cur, d, children)` -> (accepted child
    [B] or -1). Returns (path [B, D+1], accepted count [B])."""
    B, N = parents.shape
    dev = parents.device
    path = torch.zeros(B, depth + 1, dtype=torch.long, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = limit > 0
    count = torch.zeros(B, dtype=torch.long, device=dev)
    for d in range(1, depth + 1):
        children = parents == cur.unsqueeze(1)                  # [B, N]
        child = pick(cur, d, children)
        ok = alive & (child >= 0) & (d <= limit)
        cur = torch.where(ok, child.clamp(min=0), cur)
        path[:, d] = torch.where(ok, cur, torch.zeros_like(cur))
        count += ok.long()
        alive = ok
    return path, count


def chain_path(ok: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chains in a few ops instead of a walk: `ok` [B, D] says whether draft i would be
    accepted after drafts 0..i-1; returns (path [B, D+1], accepted count [B])."""
    B, D = ok.shape
    steps = torch.arange(D + 1, device=ok.device)
    ok = ok & (steps[1:].unsqueeze(0) <= limit.unsqueeze(1))
    acc = ok.long().cumprod(1).sum(1)
    return steps.unsqueeze(0) * (steps.unsqueeze(0) <= acc.unsqueeze(1)), acc


def verify(tokens: torch.Tensor, parents: torch.Tensor | None, limit: torch.Tensor, choice: torch.Tensor,
           depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(path, emitted, count) of every request (see the module docstring). `parents` None
    means chains (node i's parent is i - 1; `depth` = N - 1): a few tensor ops instead of
    the per-depth walk."""
    if parents is None:
        path, acc = chain_path(tokens[:, 1:] == choice[:, :-1], limit)
    else:
        def pick(cur, d, children):
            want = choice.gather(1, cur.unsqueeze(1))             # [B, 1]
            m = children & (tokens == want)
            return torch.where(m.any(1), m.int().argmax(1), torch.full_like(cur, -1))

        path, acc = walk(parents, limit, depth, pick)
    return path, choice.gather(1, path), acc + 1
