"""The logit processors that depend on a request's history, with vLLM's semantics and order:
allowed_token_ids, bad_words, logit_bias, min_tokens, then the repetition, frequency and
presence penalties. Pure functions of device tensors; the engine stages the histories
(`engine/penalty_step.py`).

    allowed_token_ids   logits[t] = -inf for every t not allowed
    bad_words           logits[w_last] = -inf where the history ends with the word's other tokens
    logit_bias          logits[t] += bias[t]
    min_tokens          EOS and stop_token_ids at -inf while fewer than min_tokens were generated
    repetition_penalty  for t seen in the prompt or the output: logits[t] / r if > 0, else * r
    frequency_penalty   logits[t] -= f * (times t occurs in the output)
    presence_penalty    logits[t] -= p * (t occurs in the output)

Speculation: one row per verified node, and a node's history is the request's output so far
plus the draft tokens on its path from the root (itself included): the choice at that node
is what a plain decode step would draw after those tokens, so verification stays lossless.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyBatch:
    """P penalized requests of a verify batch, as device tensors. Histories are sparse
    (row, token) pairs: row = index among the P."""

    rows: torch.Tensor          # [P] int64 index in the verify batch
    presence: torch.Tensor      # [P] float32
    frequency: torch.Tensor     # [P] float32
    repetition: torch.Tensor    # [P] float32 (1: off)
    min_tokens: torch.Tensor    # [P] int64
    out_len: torch.Tensor       # [P] int64 output tokens in `hist`
    pending: torch.Tensor       # [P] bool: `recent` tokens are output not yet in `hist`
    hist: torch.Tensor          # [2, T] (row, token) of the output tokens known on the host ...
    hist_val: torch.Tensor      # [T] float32 ... and how often each occurs
    prompt: torch.Tensor        # [2, T'] (row, token) of prompt tokens (rows with repetition only)
    bias: torch.Tensor          # [2, B] (row, token) of logit_bias entries ...
    bias_val: torch.Tensor      # [B] float32 ... and their values
    stops: torch.Tensor         # [2, S] (row, token) of the ids min_tokens masks
    use_repetition: bool
    use_min_tokens: bool
    allow: torch.Tensor | None = None        # [2, A] (row, token) of allowed_token_ids ...
    restricted: torch.Tensor | None = None   # [P] bool ... and the rows that have a list
    bad_row: torch.Tensor | None = None      # [W] int64 row of each bad-word token sequence,
    bad_prefix: torch.Tensor | None = None   # [W, M] int64 its tokens but the last, right-aligned (-2: any)
    bad_last: torch.Tensor | None = None     # [W] int64 its last token (the one banned)
    tail: torch.Tensor | None = None         # [P, M] int64 the last M output tokens in `hist` (-1: none)


def path_matrix(parents: torch.Tensor | None, P: int, N: int, depth: int, device) -> torch.Tensor:
    """[P, N, N] bool: node k (k >= 1, a draft token) is on the path from the root to node i,
    i included. `parents` None: chains (node i's path is 1..i)."""
    if parents is None:
        i = torch.arange(N, device=device)
        m = (i.unsqueeze(0) <= i.unsqueeze(1)) & (i.unsqueeze(0) >= 1)
        return m.unsqueeze(0).expand(P, N, N)
    anc = torch.zeros(P, N, N, dtype=torch.bool, device=device)
    cur = torch.arange(N, device=device).unsqueeze(0).expand(P, N).contiguous()
    for _ in range(depth + 1):
        on = cur > 0
        anc.scatter_(2, cur.clamp(min=0).unsqueeze(2), on.unsqueeze(2))   # False lands on column 0 only
        cur = torch.where(on, parents.gather(1, cur.clamp(min=0)), torch.full_like(cur, -1))
    return anc


def _dense(pairs: torch.Tensor, P: int, V: int, values: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros(P, V, dtype=torch.float32, device=pairs.device)
    if pairs.shape[1]:
        vals = values if values is not None else torch.ones(pairs.shape[1], device=pairs.device)
        out.index_put_((pairs[0], pairs[1]), vals, accumulate=True)
    return out


def apply_penalties(logits: torch.Tensor, pb: PenaltyBatch, tokens: torch.Tensor, anc: torch.Tensor,
                    recent: torch.Tensor, recent_count: torch.Tensor) -> torch.Tensor:
    """The processed logits [P, N, V] (float32) of the P penalized requests' nodes.
    `tokens` [P, N] the nodes' tokens, `anc` their `path_matrix`, `recent` [P, W] /
    `recent_count` [P] the tokens their in-flight previous step emitted (used where
    `pb.pending`)."""
    P, N, V = logits.shape
    logits = logits.float()
    if pb.allow is not None:
        allowed = _dense(pb.allow, P, V) > 0
        logits = logits.masked_fill((~allowed & pb.restricted.unsqueeze(1)).unsqueeze(1), float("-inf"))
    if pb.bad_row is not None:
        logits = _ban_bad_words(logits, pb, tokens, anc, recent, recent_count)
    counts = _dense(pb.hist, P, V, pb.hist_val)
    W = recent.shape[1]
    fresh = (torch.arange(W, device=recent.device).unsqueeze(0) < recent_count.unsqueeze(1)) & pb.pending.unsqueeze(1)
    counts.scatter_add_(1, recent, fresh.float())
    node_counts = counts.unsqueeze(1).repeat(1, N, 1)
    node_counts.scatter_add_(2, tokens.unsqueeze(1).expand(P, N, N), anc.float())
    if pb.bias.shape[1]:
        logits = logits + _dense(pb.bias, P, V, pb.bias_val).unsqueeze(1)
    if pb.use_min_tokens:
        length = (pb.out_len + recent_count * pb.pending).unsqueeze(1) + anc.sum(2)       # [P, N]
        early = length < pb.min_tokens.unsqueeze(1)
        stops = _dense(pb.stops, P, V) > 0
        logits = logits.masked_fill(early.unsqueeze(2) & stops.unsqueeze(1), float("-inf"))
    seen = node_counts > 0
    if pb.use_repetition:
        r = pb.repetition.view(P, 1, 1)
        rep = seen | (_dense(pb.prompt, P, V) > 0).unsqueeze(1)
        logits = torch.where(rep, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - pb.frequency.view(P, 1, 1) * node_counts - pb.presence.view(P, 1, 1) * seen.float()


def _history_tail(pb: PenaltyBatch, tokens: torch.Tensor, anc: torch.Tensor, recent: torch.Tensor,
                  recent_count: torch.Tensor) -> torch.Tensor:
    """[P, N, M] the last M tokens of each node's history (-1 where the history is shorter):
    the host-known output `pb.tail`, then the in-flight step's `recent` tokens (where
    `pb.pending`), then the draft tokens on the node's path from the root, itself included.
    Column m holds the (M - m)-th token from the end; all columns at once, a fixed number of
    operations however long the words are."""
    P, N = tokens.shape
    M = pb.tail.shape[1]
    f = torch.arange(M, 0, -1, device=tokens.device).view(1, 1, M)         # f-th token from the end
    depth = anc.sum(2)                                                      # [P, N] drafts on the path
    rc = (recent_count * pb.pending).view(P, 1, 1)                          # in-flight tokens counted
    # On the path: the ancestor k of node i whose depth is depth_i - f + 1.
    want = depth.unsqueeze(2) - f + 1                                       # [P, N, M]
    on = anc.unsqueeze(3) & (depth.view(P, 1, N, 1) == want.unsqueeze(2))   # [P, N, N(k), M]
    from_path = (on.long() * tokens.view(P, 1, N, 1)).sum(2)                # [P, N, M]
    g = f - depth.unsqueeze(2)                                              # from the end before the path
    from_recent = recent.gather(1, (rc - g).clamp(0, recent.shape[1] - 1).view(P, -1)).view(P, N, M)
    ti = M - (g - rc)                                                       # index into the host tail
    from_tail = pb.tail.gather(1, ti.clamp(0, max(M - 1, 0)).view(P, -1)).view(P, N, M)
    from_tail = torch.where(ti >= 0, from_tail, torch.full_like(from_tail, -1))
    return torch.where(g <= 0, from_path, torch.where(g <= rc, from_recent, from_tail))


def _ban_bad_words(logits: torch.Tensor, pb: PenaltyBatch, tokens: torch.Tensor, anc: torch.Tensor,
                   recent: torch.Tensor, recent_count: torch.Tensor) -> torch.Tensor:
    """-inf on each bad word's last token at the nodes whose history ends with its other tokens."""
    N = logits.shape[1]
    W = pb.bad_row.shape[0]
    if pb.tail.shape[1]:
        window = _history_tail(pb, tokens, anc, recent, recent_count)[pb.bad_row]     # [W, N, M]
        prefix = pb.bad_prefix.unsqueeze(1)
        match = ((window == prefix) | (prefix == -2)).all(2)                          # [W, N]
    else:
        match = torch.ones(W, N, dtype=torch.bool, device=logits.device)
    # -inf added where a word matches, 0 elsewhere: no [P, N, V] mask, and no host sync to
    # select the matches.
    add = torch.where(match, float("-inf"), 0.0)
    nodes = torch.arange(N, device=logits.device).unsqueeze(0).expand(W, N)
    return logits.index_put((pb.bad_row.unsqueeze(1).expand(W, N), nodes, pb.bad_last.unsqueeze(1).expand(W, N)),
                            add, accumulate=True)
