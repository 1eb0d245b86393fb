"""Drafting inside a step, on the device, no sync: chains (`ChainDrafter`: K greedy draft
forwards, captured by the draft CUDA graphs) and trees (`TreeStep`, around
`spec_decode.drafter.TreeDrafter`). Both write their drafts where the step reads them: the
target forward's input ids (trees: positions and tree mask too) and the verify batch.

Draft-cache layout: the pair (hidden_p, token_{p+1}) lives at draft slot p + 1 with rotary
position p; slot 0 is never read (kv_start = 1). Chain step i of a request with n tokens feeds
the pair at cache index n-1+i, rotary position n-2+i, and sees keys 1 .. n-1+i: metadata the
device derives from (row, n, depth) itself (`device.chain_steps`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaspec.device.chain_steps import DEVICE_TOKEN, REAL, SHIFTED, ChainSteps, shift_bound
from adaspec.device.shift import Shift
from adaspec.device.staging import Staging
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
    inputs: object         # staged [INPUTS + 2K, b] (device.chain_steps), padding included
    graph: object          # a captured draft graph of this batch bucket and K, or None
    B: int                 # drafting requests (the first B of the b staged)
    K: int                 # draft steps
    max_ctx_len: int       # host bound of the steps' contexts (eager split-KV sizing)
    shift: Shift | None = None   # the step's in-flight shift, applied by the draft graph (None: eagerly)
    packed_shift: object = None  # ... staged right after the inputs


class ChainDrafter:
    """K greedy draft forwards per drafting request. The host stages a few numbers per
    request; the steps' metadata, the draft's inputs and the drafts' routes into the step are
    worked out on the device (`ChainSteps`), by the draft graph itself when one replays."""

    def __init__(self, head, steps: ChainSteps, cache: list, pad_row: int):
        self.head, self.steps, self.cache, self.pad_row = head, steps, cache, pad_row
        self.backend = steps.backend

    @classmethod
    def build(cls, head, backend, cache: list, group: int, rows, stg: Staging, block_size: int, max_batch: int,
              max_k: int) -> "ChainDrafter":
        """The drafter of an engine: `rows` its DeviceRows, `stg` its step staging buffer."""
        steps = ChainSteps(max_batch, max_k, backend, group, block_size, rows.block_table, rows.last_count,
                           rows.last_token, rows.draft_hidden, stg)
        return cls(head, steps, cache, rows.pad_row)

    def stage(self, stg: Staging, plan, lay, rows: list[int], ids_d: torch.Tensor, vb, graphs,
              slack: int, shift: Shift | None = None) -> ChainBatch:
        """Stage the chains of the step's drafting requests, padded to a captured graph's batch:
        their drafts go to the target forward's input ids `ids_d` and the verify batch `vb`,
        both staged in `stg` (`slack`: the most a step in flight may move a shifted request).
        A draft graph also applies the step's in-flight `shift` (complete by now), unless it
        registered more entries than a graph launch covers (`shift_bound` of the largest
        batch): then it stays eager, and the graph applies an empty one (as when the step has
        none), never a stale one."""
        spec, reqs = lay.drafting, lay.reqs
        K, B, N = lay.N - 1, len(spec), lay.N
        graph = graphs.draft_graph(B, K) if graphs is not None else None
        shifted = set(lay.shifted)
        drows, ns, depths, tokens, flags, roots, vis = [], [], [], [], [], [], []
        for i in spec:
            r = plan.scheduled[i].req
            n = r.num_tokens
            toks = r.all_token_ids
            on_host = n - 1 < len(toks)
            drows.append(rows[i])
            ns.append(n)
            depths.append(reqs[i].depth)
            tokens.append(toks[n - 1] if on_host else 0)
            flags.append(REAL | (SHIFTED if i in shifted else 0) | (0 if on_host else DEVICE_TOKEN))
            roots.append(reqs[i].root)
            vis.append(reqs[i].vi)
        k = np.arange(1, K + 1)
        dst_ids = ids_d.storage_offset() + np.asarray(roots, dtype=np.int64)[:, None] + k
        dst_tok = vb.tokens.t.storage_offset() + np.asarray(vis, dtype=np.int64)[:, None] * N + k
        b = graph.batch if graph is not None else B
        in_graph = None
        if graph is not None:   # (an empty shift, where the graph must not apply the step's)
            fits = shift is not None and max(shift.counts()) <= shift_bound(self.steps.max_batch, K)
            in_graph = shift if fits else Shift(stg)
        inputs, packed = ChainSteps.stage(stg, K, drows, ns, depths, tokens, flags, dst_ids, dst_tok, b - B,
                                          self.pad_row, in_graph)
        return ChainBatch(inputs, graph, B, K, max(ns) + (slack if shifted else 0) + K, in_graph, packed)

    def propose(self, K: int, b: int, max_ctx_len: int, shift: bool = False) -> torch.Tensor:
        """From the loaded inputs: the step's in-flight shift applied (with `shift`), the steps
        derived, K greedy draft forwards, the drafts scattered into the step; returns them
        [b, K] (target vocabulary). Device work only: captured as is by the draft graphs."""
        if shift:
            self.steps.apply_shift(K, b)
        h, tok = self.steps.derive(K, b)
        out = []
        for meta, pos in self.steps.steps(b, K, max_ctx_len):
            with forward_context(ForwardContext(meta, self.backend, self.cache)):
                logits, h = self.head(h, tok, pos)
            tok = self.head.to_target_ids(logits.argmax(-1))
            out.append(tok)
        drafts = torch.stack(out, dim=1)
        self.steps.scatter(drafts)
        return drafts

    def run(self, batch: ChainBatch) -> torch.Tensor:
        """Draft the chains (a CUDA graph when one fits) into the target forward's input ids
        and the verify batch's tokens; returns the drafts [B, K]."""
        self.steps.load(batch.inputs, batch.packed_shift)
        if batch.graph is not None:
            return batch.graph.replay()[: batch.B]
        return self.propose(batch.K, batch.inputs.shape[1], batch.max_ctx_len)[: batch.B]


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
