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

Host work per grammar request: one xgrammar call (`traverse_draft_tree`, C++) per step, into
a bitmask the step owns for all its rows (`step_bitmask`); on the device the mask is applied
to every row with plain tensor ops (`apply_bitmask`), so the post CUDA graphs capture it.
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


def bitmask_width(vocab_size: int) -> int:
    """32-bit words per bitmask row of a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def step_bitmask(out: torch.Tensor, grammars: list, N: int, tokens: np.ndarray | None, parents: np.ndarray | None,
                 limit: np.ndarray, legalize: bool = False) -> bool:
    """Fill `out` [B*N, W] int32 (host; W = bitmask_width of the grammars' vocabulary) with
    the bitmask of B verify requests: `grammars[k]` a `RequestGrammar` or None (its rows, and
    those of a request whose grammar is complete, allow everything). `tokens` [B, N] are the
    draft tokens (None: no drafts this step), `parents` [B, N] their tree (None: chains),
    `limit` [B] each request's own depth.

    `legalize` (simulated acceptance, benchmarks only): along each chain, or a tree's path of
    first children (the only nodes simulated acceptance takes), a draft token its parent's
    mask forbids is replaced, in `tokens`, by the allowed token nearest to it, and the path goes
    on from there, as a head trained on the target would have proposed a legal token. Returns
    whether any token was replaced."""
    out.fill_(-1)
    drafted = []
    replaced = False
    for k, g in enumerate(grammars):
        if g is None or g.done:   # done: finished by the step before; this step is discarded
            continue
        m = g.matcher
        depth = int(limit[k]) if tokens is not None else 0
        if depth <= 0:
            m.fill_next_token_bitmask(out, k * N)
            continue
        if parents is None:
            if legalize:   # (a chain's walk fills its rows as it goes: nothing left to traverse)
                replaced |= _legalize(m, out, list(range(k * N, k * N + depth + 1)), tokens[k],
                                      list(range(depth + 1)), g.vocab_size)
                continue
            first, sib = _chain_links(N, depth)
        else:
            links = _tree_links(parents[k], depth)
            if legalize:   # simulated acceptance only ever takes first children: legalize that path
                path = [0]
                while links[0][path[-1]] >= 0:
                    path.append(links[0][path[-1]])
                replaced |= _legalize(m, out, [k * N] * len(path), tokens[k], path, g.vocab_size)
            first, sib = (torch.tensor(x, dtype=torch.int64) for x in links)
        m.traverse_draft_tree(first, sib, torch.from_numpy(np.ascontiguousarray(tokens[k], dtype=np.int64)),
                              out[k * N:(k + 1) * N])
        drafted.append(k)
    if drafted and N > 1:
        _revive_rejected(out.numpy().reshape(-1, N, out.shape[1]), np.asarray(drafted), tokens, parents)
    return replaced


def _legalize(m, out: torch.Tensor, rows: list[int], tokens: np.ndarray, path: list[int], vocab: int) -> bool:
    """`step_bitmask`'s legalize walk along `path` (node ids from the root): the mask of
    path[i - 1] is filled into row rows[i - 1] of `out`, and path[i]'s token in `tokens` is
    replaced by the allowed token nearest it when that mask forbids it; the matcher is rolled
    back to where it was. Returns whether a token was replaced."""
    m.fill_next_token_bitmask(out, rows[0])
    host = out.numpy()
    replaced, walked = False, 0
    for i in range(1, len(path)):
        row, t = host[rows[i - 1]], int(tokens[path[i]])
        if not (int(row[t >> 5]) >> (t & 31)) & 1:
            t = nearest_allowed(row, t, vocab)
            if t < 0:
                break
            tokens[path[i]], replaced = t, True
        if not m.accept_token(t):
            break
        walked += 1
        if m.is_terminated():   # the stop token: the output ends here, nodes below are never read
            break
        m.fill_next_token_bitmask(out, rows[i])
    if walked:
        m.rollback(walked)
    return replaced


def nearest_allowed(row: np.ndarray, t: int, vocab: int) -> int:
    """The token below `vocab` nearest to `t` (the lower one on a tie) whose bit is set in
    the packed bitmask `row` ([W] int32), or -1 when none is. Searched word by word: the
    nonzero words around t's own (a 128K-token row is 4K words; unpacking it into bits at
    every forbidden draft made a grammar step at 64 requests 40% slower on the H200)."""
    words = np.flatnonzero(row)
    if words.size == 0:
        return -1
    w = t >> 5
    j = int(np.searchsorted(words, w))
    cands = []
    if j < words.size and words[j] == w:   # t's own word: every allowed token in it
        x = int(row[w]) & 0xFFFFFFFF
        cands += [(w << 5) + b for b in range(32) if (x >> b) & 1]
        below, above = j - 1, j + 1
    else:
        below, above = j - 1, j
    if below >= 0:   # the highest allowed token of the nearest nonzero word below
        x = int(row[words[below]]) & 0xFFFFFFFF
        cands.append((int(words[below]) << 5) + x.bit_length() - 1)
    if above < words.size:   # the lowest of the nearest nonzero word above
        x = int(row[words[above]]) & 0xFFFFFFFF
        cands.append((int(words[above]) << 5) + (x & -x).bit_length() - 1)
    cands = [a for a in cands if a < vocab]
    if not cands:
        return -1
    return min(cands, key=lambda a: (abs(a - t), a))


def _revive_rejected(mask: np.ndarray, ks: np.ndarray, tokens: np.ndarray, parents: np.ndarray | None) -> None:
    """xgrammar clears every bit of a node whose own draft token its parent forbids (and leaves
    the nodes below it as they were: all set). Such a node is never reached by verification:
    it must allow everything (the module docstring says why). Found with one bit per node, the
    node's token in its parent's row: the root row is kept as it is (all clear there means the
    grammar cannot go on in this vocabulary, and the request ends with an error when its token
    is not accepted). `mask` [B, N, W] is the step's bitmask, `ks` its drafted requests."""
    N = mask.shape[1]
    tok = tokens[ks, 1:].astype(np.int64)
    if parents is None:
        par = np.broadcast_to(np.arange(N - 1), tok.shape)
    else:
        par = np.clip(parents[ks, 1:], 0, None)
    bit = (mask[ks[:, None], par, tok >> 5] >> (tok & 31).astype(np.int32)) & 1
    kk, jj = np.nonzero(bit == 0)
    mask[ks[kk], jj + 1] = -1


_SHIFTS: dict = {}


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> None:
    """Disallowed tokens of `logits` [R, V] become -inf, in place, by `mask` [R, W] int32 on
    the logits' device (bit t of row r set: token t allowed). Columns past the grammar's
    vocabulary (`vocab_size`, if the logits are wider) are left as they are, as xgrammar's own
    kernel leaves them. Plain tensor ops, no host sync: CUDA graphs capture it."""
    n = min(vocab_size, logits.shape[-1], mask.shape[-1] * 32)
    key = (mask.device, n)
    bits = _SHIFTS.get(key)
    if bits is None:   # (word, bit) of every column, built once per device and width
        col = torch.arange(n, device=mask.device)
        bits = _SHIFTS[key] = (col // 32, (col % 32).to(torch.int32))
    word, shift = bits
    allowed = ((mask[:, word] >> shift) & 1).bool()
    logits[:, :n].masked_fill_(~allowed, float("-inf"))


def legal_drafts(mask: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
    """[B, N] bool: whether node j's token is allowed by its parent's mask (`mask` [B*N, W] on
    the device; chains when `parents` is None). For simulated acceptance (benchmarks) only."""
    B, N = tokens.shape
    m = mask.view(B, N, -1)
    par = parents if parents is not None else torch.arange(-1, N - 1, device=tokens.device).expand(B, N)
    rows = m.gather(1, par.clamp(min=0).unsqueeze(-1).expand(B, N, m.shape[-1]))   # each node's parent's mask
    words = rows.gather(2, (tokens // 32).clamp(max=m.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return ((words >> (tokens % 32)) & 1).bool()
