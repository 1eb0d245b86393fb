"""Tree drafting (topk > 1) with an EAGLE-3 head, SGLang semantics, on the device: no host
round trip between depths, no Python per request once staged. (Chains, topk = 1, are drafted
by the runner's `draft_chain`, which CUDA graphs capture.)

Draft-cache layout (shared block table with the target): the pair (hidden_p, token_{p+1})
lives at draft slot p + 1 with rotary position p; slot 0 is never read (kv_start = 1). This
shift makes every draft KV entry in block b depend only on tokens inside blocks 0..b, which
is what lets prefix-cached blocks carry valid draft KV too.

For a request with n tokens (root = tokens[n-1], target KV at 0..n-2), topk k, S steps:
  step 0: one query (the request's draft hidden, the root) at cache index n-1 -> its top k
          tokens are the depth-1 candidates (score = log-probability)
  step i: the best k candidates of depth i (the frontier, best first) are fed at cache
          indices n + (i-1)*k + r, each attending to the prefix, its frontier ancestors and
          itself; each yields k children (score = sum of log-probabilities on the path)
Finally the best num_draft_tokens - 1 candidates by score form the tree (a child never
scores above its parent, so the selection is ancestor-closed), ordered by depth, then score.

Every request of a step runs every depth with k query rows (graph-friendly shapes); a
request whose own budget is shallower (`DraftShape.capped`) gets its deeper candidates
scored -inf, its deeper queries write no KV, and the nodes past its own `num_draft_tokens`
are padding (parent -1, masked to the root only, never accepted).

The staged metadata is relative to n, so a request whose previous step is still in flight
is corrected on the device like every other forward (`device.shift.Shift`), and tree steps
overlap like chain steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaspec.device.shift import Shift
from adaspec.device.staging import Staging, stage_forward
from adaspec.layers.attention import ForwardContext, forward_context


@dataclass
class StagedTrees:
    """One step's tree drafting, staged: per-depth forward metadata and per-request limits."""

    steps: list            # (AttnMeta, positions) per depth, in the drafter's own buffer
    B: int                 # speculating requests
    k: int                 # topk
    S: int                 # depths (the deepest request's num_steps)
    N: int                 # tree size incl. the root (the largest num_draft_tokens)
    limits: object         # staged int64 [2, B]: own num_steps, own num_draft_tokens - 1 (0: padding)


@dataclass
class Trees:
    """Drafted trees on the device, B requests x N nodes (node 0 = the root), in the layout
    the verifiers take (parents precede children, siblings best first)."""

    tokens: torch.Tensor   # [B, N] int64 target-vocabulary ids
    parents: torch.Tensor  # [B, N] int64, -1 for the root and padding nodes
    depths: torch.Tensor   # [B, N] int64, 0 for the root and padding nodes
    mask: torch.Tensor     # [B, N, N] bool: node i sees node j (itself and its ancestors)
    depth: torch.Tensor    # [B] int64 depth of each tree


def cap_of_candidates(k: int, S: int) -> int:
    """Candidates drafted for topk k over S steps: k at depth 1, k*k at each further depth."""
    return k + (S - 1) * k * k


class TreeDrafter:
    """A step's trees (see the module docstring): `stage` on the host, `propose` on the
    device (eagerly, or replayed from a CUDA graph that captured it)."""

    def __init__(self, head, backend, block_size: int, group: int):
        self.head = head
        self.backend = backend
        self.block_size = block_size
        self.group = group

    # ---- host: staging ----------------------------------------------------------------------
    def stage(self, dstg: Staging, reqs, shapes, rows, block_table: torch.Tensor, pad_to: int = 0,
              pad_row: int = 0, shift: Shift | None = None, slack: int = 0) -> StagedTrees:
        """Stage the draft forwards of `reqs` (with their `DraftShape`s, device `rows`) into
        `dstg` (begun and committed here), padded with `pad_to - len(reqs)` requests that see
        no keys and write nothing (for a CUDA graph of that batch size). With `shift`,
        requests whose previous step is in flight (`req.pending`) are corrected on the device,
        and `slack` (the most a step in flight may shift them) bounds their context lengths.
        The layout depends only on (batch, topk, depths), so a graph replays it."""
        k = shapes[0].topk
        if any(s.topk != k for s in shapes):
            raise ValueError(f"one tree step needs one topk, got {sorted({s.topk for s in shapes})}")
        S = max(s.num_steps for s in shapes)
        N = max(s.num_draft_tokens for s in shapes)
        pad = max(0, pad_to - len(reqs))
        moved = [b for b, r in enumerate(reqs) if r.pending] if shift is not None else []
        return self.stage_arrays(
            dstg, k, S, N, ns=[r.num_tokens for r in reqs] + [2] * pad,
            own_steps=[s.num_steps for s in shapes] + [0] * pad,
            own_nodes=[s.num_draft_tokens - 1 for s in shapes] + [0] * pad,
            rows=list(rows) + [pad_row] * pad, blocks=[r.block_ids for r in reqs] + [None] * pad,
            block_table=block_table, moved=moved, shift=shift if moved else None, slack=slack if moved else 0)

    def stage_arrays(self, dstg: Staging, k: int, S: int, N: int, *, ns, own_steps, own_nodes, rows, blocks,
                     block_table: torch.Tensor, moved=(), shift: Shift | None = None, slack: int = 0) -> StagedTrees:
        """`stage` on plain arrays; a request whose `blocks` is None is padding (no keys, no
        writes, its own depth 0)."""
        B = len(ns)
        bs = self.block_size
        ns = np.asarray(ns, dtype=np.int64)
        own_steps = np.asarray(own_steps, dtype=np.int64)
        real = np.array([b is not None for b in blocks])
        moved_rows = [rows[b] for b in moved]
        dstg.begin()
        steps = []
        for i in range(S):
            q = 1 if i == 0 else k
            active = own_steps > i
            if i == 0:
                cidx = ns - 1
                ctx = ns.copy()
                mstart, moff, mask = None, None, None
            else:
                cidx = (ns + (i - 1) * k)[:, None] + np.arange(k)[None, :]
                ctx = np.where(active, ns + i * k, ns)     # inactive: the prefix only, no tree region
                mstart = ns
                moff = np.arange(B, dtype=np.int64) * (k * i * k)
                mask = np.zeros(B * k * i * k, np.uint8)   # filled on the device
            ctx = np.where(real, ctx, 0)
            cidx = cidx.reshape(B, q)
            slots = [[blk[c // bs] * bs + c % bs if a else -1 for c in row] if blk is not None else [-1] * q
                     for blk, row, a in zip(blocks, cidx.tolist(), active)]
            sr = [j for b in moved for j in range(b * q, b * q + q)]
            meta, _, pos = stage_forward(
                dstg, self.backend, block_table, bs, self.group, q_lens=[q] * B, ctx_len=ctx, kv_start=[1] * B,
                req_row=rows, positions=np.repeat(ns - 2 + i, q), cache_index=cidx.reshape(-1),
                slots=np.asarray(slots, dtype=np.int64).reshape(-1), mask_start=mstart, mask_offset=moff, mask=mask,
                max_ctx_len=int(ctx.max()) + slack,
                shift=shift, shift_rows=(sr, [rows[j // q] for j in sr]), shift_reqs=(moved, moved_rows))
            steps.append((meta, pos))
        limits = dstg.add(np.stack([own_steps, np.asarray(own_nodes, dtype=np.int64)]), torch.int64)
        dstg.commit()
        return StagedTrees(steps, B, k, S, N, limits)

    # ---- device: drafting -------------------------------------------------------------------
    def _step(self, meta, cache, h, tokens, pos):
        with forward_context(ForwardContext(meta, self.backend, cache)):
            logits, g = self.head(h, tokens, pos)
        return torch.log_softmax(logits, dim=-1), g

    @torch.inference_mode()
    def propose(self, st: StagedTrees, h: torch.Tensor, root: torch.Tensor, cache: list) -> Trees:
        """Draft the trees: `h` [B, H] each request's draft hidden at its last pair, `root` [B]
        its last token, `cache` one (k, v) pair per draft layer. Device ops only."""
        B, k, S, N = st.B, st.k, st.S, st.N
        dev = h.device
        own_steps, own_nodes = st.limits.t
        meta, pos = st.steps[0]
        logp, g = self._step(meta, cache, h, root, pos)
        top = logp.topk(k, dim=-1)
        toks = [self.head.to_target_ids(top.indices)]          # per depth: [B, k], then [B, k*k]
        scores = [top.values]
        parents = [torch.full((B, k), -1, dtype=torch.long, device=dev)]
        rows_of = torch.arange(B, device=dev).unsqueeze(1).expand(B, k)   # query row that made each
        eye = torch.eye(k, dtype=torch.uint8, device=dev).expand(B, k, k)
        fmask = None
        base = 0                                                # candidate index of depth i's first
        for i in range(1, S):
            # The frontier, best first (a stable sort: equal scores keep drafting order).
            fscore, fidx = torch.sort(scores[-1], dim=1, descending=True, stable=True)
            fscore, fidx = fscore[:, :k], fidx[:, :k]
            qtok = toks[-1].gather(1, fidx)
            qh = g[rows_of.gather(1, fidx).reshape(-1)]
            if fmask is None:
                fmask = eye
            else:   # a frontier node sees its parent's ancestors (a row of the last frontier), then itself
                prow = (fidx // k).unsqueeze(2).expand(B, k, fmask.shape[2])
                fmask = torch.cat([fmask.gather(1, prow), eye], dim=2)
            meta, pos = st.steps[i]
            meta.mask[: fmask.numel()] = fmask.reshape(-1)
            logp, g = self._step(meta, cache, qh, qtok.reshape(-1), pos)
            top = logp.view(B, k, -1).topk(k, dim=-1)
            s = fscore.unsqueeze(2) + top.values
            s = torch.where((own_steps > i).view(B, 1, 1), s, torch.full_like(s, float("-inf")))
            toks.append(self.head.to_target_ids(top.indices).reshape(B, k * k))
            scores.append(s.reshape(B, k * k))
            parents.append((base + fidx).unsqueeze(2).expand(B, k, k).reshape(B, k * k))
            base += scores[-2].shape[1]
            rows_of = (torch.arange(B * k, device=dev).view(B, k, 1)).expand(B, k, k).reshape(B, k * k)
        return select(torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1), root, own_nodes, k, S, N)


def select(tok: torch.Tensor, score: torch.Tensor, parent: torch.Tensor, root: torch.Tensor,
           own_nodes: torch.Tensor, k: int, S: int, N: int) -> Trees:
    """Keep each request's best `own_nodes` candidates (at most N - 1) as its tree.
    tok/score/parent [B, C]: candidates in drafting order (depth 1 first), parent = candidate
    index or -1. Ties in score go to the earlier candidate, as the host order did."""
    B, C = score.shape
    dev = score.device
    depth_of = torch.cat([torch.ones(k, dtype=torch.long, device=dev)]
                         + [torch.full((k * k,), d, dtype=torch.long, device=dev) for d in range(2, S + 1)])
    # Best first; a stable sort keeps the earlier candidate first among equal scores.
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, : N - 1]
    rank = torch.arange(N - 1, device=dev).unsqueeze(0)
    keep = rank < own_nodes.unsqueeze(1)
    d = depth_of[order]
    key = torch.where(keep, d * N + rank, torch.full_like(d, S * N + N))   # by depth, then score
    by_depth = torch.sort(key, dim=1, stable=True).indices
    sel, keep, d = order.gather(1, by_depth), keep.gather(1, by_depth), d.gather(1, by_depth)
    pc = parent.gather(1, sel)                                  # parents as candidate indices
    match = (sel.unsqueeze(1) == pc.unsqueeze(2)) & keep.unsqueeze(1)
    pnode = torch.where(match.any(2), match.int().argmax(2) + 1, 0)   # node index; 0 = root
    col = torch.full((B, 1), -1, dtype=torch.long, device=dev)
    tokens = torch.cat([root.view(B, 1), torch.where(keep, tok.gather(1, sel), 0)], 1)
    parents = torch.cat([col, torch.where(keep, pnode, -1)], 1)
    depths = torch.cat([torch.zeros_like(col), torch.where(keep, d, 0)], 1)
    # Ancestor masks: a node sees itself and what its parent sees; padding sees the root only.
    eye = torch.eye(N, dtype=torch.bool, device=dev).expand(B, N, N)
    pad = torch.zeros(B, N, N, dtype=torch.bool, device=dev)
    pad[:, :, 0] = True
    real = torch.cat([torch.ones_like(col, dtype=torch.bool), keep], 1).unsqueeze(2)
    up = parents.clamp(min=0).unsqueeze(2).expand(B, N, N)
    has_parent = (parents >= 0).unsqueeze(2)
    mask = eye.clone()
    for _ in range(S):
        mask = eye | (has_parent & mask.gather(1, up))
    mask = torch.where(real, mask, pad)
    return Trees(tokens, parents, depths, mask, depths.max(1).values)
