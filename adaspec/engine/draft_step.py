"""Drafting inside a step, on the device, no sync: chains (`ChainDrafter`: K greedy draft
forwards, captured by the draft CUDA graphs) and trees (`TreeStep`, around
`spec_decode.drafter.TreeDrafter`). Both write their drafts where the step reads them: the
target forward's input ids (trees: positions and tree mask too) and the verify batch.

Draft-cache layout: the pair (hidden_p, token_{p+1}) lives at draft slot p + 1 with rotary
position p; slot 0 is never read (kv_start = 1). Chain step i of a request with n tokens feeds
the pair at cache index n-1+i, rotary position n-2+i, and sees keys 1 .. n-1+i.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaspec.device.shift import Shift
from adaspec.device.staging import Staging, stage_decode_steps
from adaspec.layers.attention import ForwardContext, forward_context
from adaspec.spec_decode.drafter import TreeDrafter


@dataclass
class DraftRoutes:
    """Where the drafts of the drafting requests come from and go (staged, [B] or [B, K]):
    their device rows, their verify index, their root row in the target forward and the K
    draft rows after it."""

    rows: object
    vidx: object
    root_rows: object
    draft_rows: object


def stage_routes(stg: Staging, lay, rows: list[int], K: int) -> DraftRoutes:
    spec, reqs = lay.drafting, lay.reqs
    root = [reqs[i].root for i in spec]
    src, vidx, root_rows = stg.add_rows([[rows[i] for i in spec], [reqs[i].vi for i in spec], root], torch.int64)
    h, draft_rows = stg.reserve((len(spec), K), torch.int64)
    h[...] = np.asarray(root, dtype=np.int64)[:, None] + np.arange(1, K + 1)
    return DraftRoutes(src, vidx, root_rows, draft_rows)


@dataclass
class ChainBatch:
    steps: list            # (AttnMeta, positions) per draft step, in the drafter's own buffer
    graph: object          # a captured draft graph of this batch bucket and K, or None
    B: int                 # drafting requests
    routes: DraftRoutes


class ChainDrafter:
    """K greedy draft forwards per drafting request."""

    def __init__(self, head, backend, cache: list, block_table: torch.Tensor, pad_row: int, block_size: int,
                 group: int):
        self.head, self.backend, self.cache = head, backend, cache
        self.block_table, self.pad_row, self.block_size, self.group = block_table, pad_row, block_size, group

    def stage_steps(self, stg: Staging, ns: np.ndarray, blocks: list, depth: list, rows: list, K: int,
                    max_ctx_len: int | None = None, shift: Shift | None = None, moved=(), slack: int = 0) -> list:
        """Stage K draft steps (begun and committed here) for requests with `ns` tokens; a
        request whose `blocks` is None is padding (no keys, writes nothing, ns = 2 keeps its
        positions >= 0). `max_ctx_len` overrides the bound (graph capture: the longest context).
        The steps' metadata goes to the drafter's own static buffer, laid out per (batch, K)
        so that a captured draft graph finds it; all K steps are staged as one (`stage_decode_steps`)."""
        bs, B = self.block_size, len(ns)
        st = np.arange(K, dtype=np.int64)[:, None]
        cidx = ns[None, :] - 1 + st                                   # [K, B]
        ctx = cidx + 1
        if None in blocks:   # padding: no keys
            ctx *= np.array([b is not None for b in blocks])
        # Step k writes the pair at cache index n-1+k, for the request's own depth only.
        none = [-1] * K
        slots = np.array([none if blk is None else
                          [blk[c // bs] * bs + c % bs for c in range(n - 1, n - 1 + min(K, d))] + none[:max(0, K - d)]
                          for blk, n, d in zip(blocks, ns.tolist(), depth)], dtype=np.int64).reshape(B, K).T
        if max_ctx_len is not None:
            bound = [max_ctx_len] * K
        else:   # the longest context of each step (0 when every request is padding)
            top = max((n for n, b in zip(ns.tolist(), blocks) if b is not None), default=None)
            bound = [(0 if top is None else top + k) + slack for k in range(K)] if B else [0] * K
        stg.begin()
        steps = stage_decode_steps(stg, self.backend, self.block_table, bs, self.group, ctx_len=ctx,
                                   kv_start=1, req_row=rows, positions=cidx - 1,
                                   cache_index=cidx, slots=slots, max_ctx_len=bound, shift=shift if moved else None,
                                   shift_reqs=(list(moved), [rows[k] for k in moved]))
        stg.commit()
        return steps

    def stage(self, stg: Staging, dstg: Staging, plan, lay, rows: list[int], graphs, shift: Shift | None,
              slack: int) -> ChainBatch:
        """Stage the chains of the step's drafting requests, padded to a captured graph's batch."""
        spec = lay.drafting
        K, B = lay.N - 1, len(spec)
        graph = graphs.draft_graph(B, K) if graphs is not None else None
        pad = (graph.batch if graph is not None else B) - B
        reqs = [plan.scheduled[i].req for i in spec]
        moved = [k for k, r in enumerate(reqs) if r.pending] if shift is not None else []
        steps = self.stage_steps(
            dstg, np.array([r.num_tokens for r in reqs] + [2] * pad, dtype=np.int64),
            [r.block_ids for r in reqs] + [None] * pad, [lay.reqs[i].depth for i in spec] + [0] * pad,
            [rows[i] for i in spec] + [self.pad_row] * pad, K, shift=shift, moved=moved, slack=slack if moved else 0)
        return ChainBatch(steps, graph, B, stage_routes(stg, lay, rows, K))

    def draft(self, h: torch.Tensor, tok: torch.Tensor, steps) -> torch.Tensor:
        """K greedy draft forwards from (hidden, token) [B]; returns target-vocabulary drafts
        [B, K]. Captured as is by the draft CUDA graphs."""
        out = []
        for meta, pos in steps:
            with forward_context(ForwardContext(meta, self.backend, self.cache)):
                logits, h = self.head(h, tok, pos)
            tok = self.head.to_target_ids(logits.argmax(-1))
            out.append(tok)
        return torch.stack(out, dim=1)

    def run(self, batch: ChainBatch, draft_hidden: torch.Tensor, ids_d: torch.Tensor, vtok: torch.Tensor) -> None:
        """Draft the chains (a CUDA graph when one fits); write the drafts into the target
        forward's input ids and the verify batch's tokens."""
        r = batch.routes
        if batch.graph is not None:
            dt = batch.graph.run(draft_hidden, r.rows.t, ids_d, r.root_rows.t)[: batch.B]
        else:
            dt = self.draft(draft_hidden[r.rows.t], ids_d[r.root_rows.t], batch.steps)
        # (index_copy_, not indexed assignment: the same one kernel each, less host time)
        ids_d.index_copy_(0, r.draft_rows.t.reshape(-1), dt.reshape(-1))
        vtok[:, 1:].index_copy_(0, r.vidx.t, dt)


@dataclass
class TreeBatch:
    staged: object         # spec_decode.drafter.StagedTrees
    graph: object          # a captured tree graph, or None
    mask_offsets: object   # staged [B]: each tree's offset in the forward's tree mask
    routes: DraftRoutes


class TreeStep:
    """The step's trees: staged by `TreeDrafter.stage`, drafted on the device, routed into the
    target forward (ids, positions = root's + depth, tree mask) and the verify batch."""

    def __init__(self, drafter: TreeDrafter, cache: list, block_table: torch.Tensor, pad_row: int):
        self.drafter, self.cache, self.block_table, self.pad_row = drafter, cache, block_table, pad_row

    def stage(self, stg: Staging, dstg: Staging, plan, lay, rows: list[int], tree_offsets: list, graphs,
              shift: Shift | None, slack: int) -> TreeBatch:
        spec = lay.drafting
        shapes = [plan.scheduled[i].draft for i in spec]
        S = max(d.num_steps for d in shapes)
        graph = graphs.tree_graph(len(spec), S, lay.N) if graphs is not None else None
        staged = self.drafter.stage(dstg, [plan.scheduled[i].req for i in spec], shapes, [rows[i] for i in spec],
                                    self.block_table, pad_to=graph.batch if graph else 0, pad_row=self.pad_row,
                                    shift=shift, slack=slack)
        return TreeBatch(staged, graph, stg.add(tree_offsets, torch.int64), stage_routes(stg, lay, rows, lay.N - 1))

    def run(self, t: TreeBatch, draft_hidden: torch.Tensor, meta, ids_d: torch.Tensor, pos_d: torch.Tensor,
            vtok: torch.Tensor, vpar: torch.Tensor, vlim: torch.Tensor) -> None:
        r = t.routes
        root, moff = r.root_rows.t, t.mask_offsets.t
        h, tok = draft_hidden[r.rows.t], ids_d[root]
        tr = t.graph.run(h, tok) if t.graph is not None else self.drafter.propose(t.staged, h, tok, self.cache)
        rows = r.draft_rows.t
        ids_d[rows] = tr.tokens[:, 1:]
        pos_d[rows] = pos_d[root].unsqueeze(1) + tr.depths[:, 1:]
        N = tr.tokens.shape[1]
        at = moff.unsqueeze(1) + torch.arange(N * N, device=moff.device)
        meta.mask[at.reshape(-1)] = tr.mask.reshape(-1).to(torch.uint8)
        vi = r.vidx.t
        vtok[vi] = tr.tokens
        vpar[vi] = tr.parents
        vlim[vi] = tr.depth
