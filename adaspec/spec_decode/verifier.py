"""Batched verification of draft trees (chains are trees with one child per node): pure
functions on device tensors, no engine state, no host sync.

Inputs describe B requests with N nodes each (node 0 = the root, the last emitted token;
parents precede children; siblings best-first), padded to a common N:
    tokens  [B, N] int64   target-vocabulary ids (tokens[:, 0] = root)
    parents [B, N] int64   parent node (-1 for the root and for padding nodes)
    limit   [B]    int64   most draft tokens a request may accept (its own depth; 0 = none)
Outputs, shared by every verifier:
    path    [B, D+1] int64 node accepted at each depth (path[:, 0] = 0; past the end: 0)
    emitted [B, D+1] int64 emitted tokens: accepted drafts, then the bonus token
    count   [B]      int64 tokens emitted (accepted + 1)
Emitted tokens at depth d are the target's choice at path[d-1]; for greedy verification that
is the argmax, which is why greedy needs no draft-token gathering.
"""
from __future__ import annotations

import torch


def _walk(parents: torch.Tensor, limit: torch.Tensor, depth: int, pick) -> tuple[torch.Tensor, torch.Tensor]:
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


def _drafts_on(tokens, path) -> torch.Tensor:
    """[B, D+1]: the draft tokens along `path` (accepted node d's token in column d-1), the
    columns past the accepted ones filled with a placeholder the caller overwrites."""
    return tokens.gather(1, torch.cat([path[:, 1:], path[:, :1]], dim=1))


def verify_greedy(tokens, parents, limit, argmax, depth: int):
    """Accept the child whose token equals the target's argmax at the current node."""
    def pick(cur, d, children):
        want = argmax.gather(1, cur.unsqueeze(1))                 # [B, 1]
        m = children & (tokens == want)
        return torch.where(m.any(1), m.int().argmax(1), torch.full_like(cur, -1))

    path, acc = _walk(parents, limit, depth, pick)
    emitted = argmax.gather(1, path)                              # choice at path[d] = token d+1
    return path, emitted, acc + 1


def verify_simulated(tokens, parents, limit, uniforms, depth: int):
    """Benchmarking: accept the best (first) child at each depth with the probability whose
    draws `uniforms [B, D]` were compared with the rate already (bool). Emits the drafts;
    the caller fills the bonus token at the last accepted node."""
    def pick(cur, d, children):
        first = torch.where(children.any(1), children.int().argmax(1), torch.full_like(cur, -1))
        return torch.where(uniforms[:, d - 1], first, torch.full_like(cur, -1))

    path, acc = _walk(parents, limit, depth, pick)
    emitted = _drafts_on(tokens, path)
    return path, emitted, acc + 1


def _chain_path(ok: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chains in a few ops instead of a walk: `ok` [B, D] says whether draft i would be
    accepted after drafts 0..i-1; returns (path [B, D+1], accepted count [B])."""
    B, D = ok.shape
    steps = torch.arange(D + 1, device=ok.device)
    ok = ok & (steps[1:].unsqueeze(0) <= limit.unsqueeze(1))
    acc = ok.long().cumprod(1).sum(1)
    return steps.unsqueeze(0) * (steps.unsqueeze(0) <= acc.unsqueeze(1)), acc


def verify_chain_greedy(tokens, limit, argmax):
    """`verify_greedy` for chains (node i's parent is i - 1; tokens, argmax [B, D+1])."""
    path, acc = _chain_path(tokens[:, 1:] == argmax[:, :-1], limit)
    return path, argmax.gather(1, path), acc + 1


def verify_chain_simulated(tokens, limit, uniforms):
    """`verify_simulated` for chains (uniforms [B, >= D] bool)."""
    D = tokens.shape[1] - 1
    path, acc = _chain_path(uniforms[:, :D], limit)
    return path, _drafts_on(tokens, path), acc + 1


def verify_chain_sampled(tokens, limit, probs, uniforms, noise):
    """Rejection sampling of chains whose drafts are deterministic (q one-hot): draft token
    x_i is accepted with probability p_i(x_i); at the first rejection the bonus is drawn from
    the residual p_i with x_i removed, after a full acceptance from p_K. Exact target law.

    tokens [B, K+1] (root first), probs [B, K+1, V], uniforms [B, K], noise [B, V] Exp(1).
    """
    B, K1, V = probs.shape
    K = K1 - 1
    dev = probs.device
    drafts = tokens[:, 1:]
    p_draft = probs[:, :K].gather(2, drafts.unsqueeze(2)).squeeze(2)   # [B, K]
    ok = (uniforms < p_draft) & (torch.arange(K, device=dev).unsqueeze(0) < limit.unsqueeze(1))
    acc = ok.long().cumprod(1).sum(1)                                   # [B]
    p_last = probs[torch.arange(B, device=dev), acc]                    # [B, V]
    rejected = acc < limit
    rej_tok = drafts.gather(1, acc.clamp(max=K - 1).unsqueeze(1)).squeeze(1) if K else acc
    residual = p_last.clone()
    residual[torch.arange(B, device=dev), rej_tok] = torch.where(rejected, 0.0, residual[torch.arange(B, device=dev), rej_tok])
    total = residual.sum(1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_last)
    bonus = (residual / noise).argmax(1)
    path = torch.arange(K1, device=dev).unsqueeze(0).expand(B, K1) * (torch.arange(K1, device=dev) <= acc.unsqueeze(1))
    emitted = torch.cat([drafts, drafts[:, :1]], dim=1).clone() if K else bonus.unsqueeze(1).clone()
    emitted.scatter_(1, acc.unsqueeze(1), bonus.unsqueeze(1))
    return path, emitted, acc + 1


def verify_tree_sampled(tokens, parents, limit, probs, uniforms, noise, depth: int):
    """Rejection sampling of trees whose drafts are deterministic (q one-hot), the batched law
    of `verify.verify_sampled`: at the current node p_res = p(node); children are tried in
    order (best-first = ascending node index), child c with token x accepted with probability
    p_res(x); on rejection x is zeroed in p_res and p_res renormalised (when nothing is left,
    p_res falls back to the unmodified p(node) and no further sibling is tried). If no child
    is accepted the bonus is drawn from p_res, otherwise the walk continues from c (and after
    `limit` acceptances the bonus is drawn from the unmodified p at the last node). Every
    emitted token is an exact sample of the target distribution.

    probs [B, N, V] float, uniforms [B, D, W] U(0,1) (one draw per depth and sibling rank),
    noise [B, V] Exp(1) (bonus = argmax(p_res / noise)), depth D: the deepest path that can
    be accepted (at most N - 1; a tree's own number of drafting steps is enough).
    W must be >= the most children any node has: the children of rank >= W are never tried
    (not checked; the law stays exact, those drafts just never get accepted).
    """
    B, W = probs.shape[0], uniforms.shape[2]
    dev = probs.device
    rows = torch.arange(B, device=dev)
    path = torch.zeros(B, depth + 1, dtype=torch.long, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)   # every node on the path so far accepted
    res = probs[:, 0]                                     # bonus distribution of rows that stopped
    for d in range(1, depth + 1):
        base = probs[rows, cur]                           # [B, V] target at the current node
        p_res = base
        children = parents == cur.unsqueeze(1)            # [B, N]; never padding (parent -1)
        rank = children.long().cumsum(1)                  # 1-based sibling rank at children
        trying = alive & (d <= limit)                     # rows still looking for a child here
        child = torch.full_like(cur, -1)
        for r in range(W):
            kth = children & (rank == r + 1)
            c = kth.long().argmax(1)
            try_now = trying & kth.any(1)
            x = tokens.gather(1, c.unsqueeze(1))          # [B, 1]
            px = p_res.gather(1, x).squeeze(1)
            acc = try_now & (px > 0) & (uniforms[:, d - 1, r] < px)
            rej = try_now & ~acc
            child = torch.where(acc, c, child)
            zeroed = p_res.scatter(1, x, 0.0)
            total = zeroed.sum(1, keepdim=True)
            empty = rej & (total.squeeze(1) <= 0)         # nothing left: fall back to p(node), stop
            renorm = torch.where(empty.unsqueeze(1), base, zeroed / total.clamp(min=1e-30))
            p_res = torch.where(rej.unsqueeze(1), renorm, p_res)
            trying = rej & ~empty
        ok = alive & (child >= 0)                         # (child >= 0 implies d <= limit)
        res = torch.where((alive & ~ok).unsqueeze(1), p_res, res)
        cur = torch.where(ok, child, cur)
        path[:, d] = torch.where(ok, cur, torch.zeros_like(cur))
        alive = ok
    res = torch.where(alive.unsqueeze(1), probs[rows, cur], res)    # accepted all the way down
    acc = (path[:, 1:] > 0).long().sum(1)
    bonus = (res / noise).argmax(1)
    emitted = _drafts_on(tokens, path)
    emitted.scatter_(1, acc.unsqueeze(1), bonus.unsqueeze(1))
    return path, emitted, acc + 1
