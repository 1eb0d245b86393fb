"""Test-only host reference of tree verification (the per-tree oracle the batched verifier is
checked against), one request at a time, in plain Python: no engine state.

Greedy: walk from the root, following the child whose token equals the target's argmax at
the current node; the argmax at the last accepted node is the bonus token.

Sampling: at each node the target's distribution p (after temperature / top-k / top-p) is
compared with the children in order (they are deterministic top-k picks, i.e. q = one-hot):
child x is accepted with probability p_res(x); on rejection x is removed from the residual,
p_res <- normalise(p_res with x zeroed), and the next sibling is tried. If every child is
rejected the bonus token is drawn from the residual. Each emitted token is therefore an
exact sample of the target distribution (standard speculative sampling with q = delta).

Both return (accepted node indices along the path, bonus token).
"""
from __future__ import annotations

import torch

from adaspec.spec_decode.tree import DraftTree


def verify_greedy(tree: DraftTree, target_argmax: list[int]) -> tuple[list[int], int]:
    kids = tree.children()
    node, path = 0, []
    while True:
        want = target_argmax[node]
        nxt = next((c for c in kids[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def verify_sampled(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None,
                   default: torch.Generator | None = None) -> tuple[list[int], int]:
    """probs: [N, V] target probabilities at each tree node (rows in node order)."""
    kids = tree.children()
    node, path = 0, []
    g = generator or default
    while True:
        p = probs[node].clone()
        accepted = None
        for c in kids[node]:
            x = tree.tokens[c]
            px = float(p[x])
            if px > 0.0 and float(torch.rand((), device=p.device, generator=g)) < px:
                accepted = c
                break
            p[x] = 0.0
            total = float(p.sum())
            if total <= 0.0:  # numerically nothing left; fall back to the unmodified target
                p = probs[node].clone()
                break
            p /= total
        if accepted is None:
            noise = torch.empty_like(p).exponential_(generator=g)
            return path, int((p / noise).argmax())
        path.append(accepted)
        node = accepted
