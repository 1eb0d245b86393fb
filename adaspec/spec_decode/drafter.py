"""Drafting with an EAGLE-3 head: chains (topk = 1) and trees (topk > 1), SGLang semantics.

Draft-cache layout (shared block table with the target): the pair (hidden_p, token_{p+1})
lives at draft slot p + 1 with rotary position p; slot 0 is never read (kv_start = 1). This
shift makes every draft KV entry in block b depend only on tokens inside blocks 0..b, which
is what lets prefix-cached blocks carry valid draft KV too.

For a request with n tokens (last token t = tokens[n-1], target KV at 0..n-2):
  step 0: query (fc-hidden of pair n-2, t) at slot n-1 -> depth-1 candidates (top `topk`)
  step i: the best `topk` candidates of depth i (the frontier) are fed at slots
          n + (i-1)*topk + r, each attending to the prefix, its ancestors and itself,
          and each yields `topk` children (score = sum of log-probabilities on the path).
Finally the best num_draft_tokens - 1 candidates by score form the tree (a parent scores
at least as high as its child, so the selection is ancestor-closed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adaspec.engine.kv_cache import block_table_tensor, slot_of
from adaspec.engine.request import Request
from adaspec.layers.attention import AttentionMetadata
from adaspec.spec_decode.eagle3 import Eagle3Head
from adaspec.spec_decode.tree import DraftShape, DraftTree


@dataclass
class _Cand:
    token: int
    score: float
    parent: int          # candidate index, -1 = root
    depth: int
    slot: int = -1       # draft slot if it was expanded (frontier)
    hidden_row: int = -1  # row of its query's output hidden in that step's output


@dataclass
class _ReqState:
    req: Request
    shape: DraftShape
    cands: list[_Cand] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)


class Drafter:
    def __init__(self, head: Eagle3Head, backend, block_size: int, device: torch.device):
        self.head = head
        self.backend = backend
        self.block_size = block_size
        self.device = device

    def slot(self, req: Request, idx: int) -> int:
        return slot_of(req, idx, self.block_size)

    def block_tables(self, reqs: list[Request]) -> torch.Tensor:
        return block_table_tensor(reqs, self.device)

    @torch.inference_mode()
    def propose(self, reqs: list[tuple[Request, DraftShape]], cache: list) -> list[DraftTree]:
        """`cache`: one (k, v) pair per draft layer, passed through to the head."""
        states = [_ReqState(r, s) for r, s in reqs]
        dev = self.device
        # ---- step 0: one query per request at its last pair ----
        rs = [st.req for st in states]
        n = [r.num_tokens for r in rs]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([self.slot(r, k - 1) for r, k in zip(rs, n)], device=dev),
            query_start=list(range(len(rs) + 1)), context_lens=n, kv_start=[1] * len(rs),
            cache_index=torch.tensor([k - 1 for k in n], device=dev), block_tables=self.block_tables(rs),
            custom_masks=[None] * len(rs), positions=torch.tensor([k - 2 for k in n], device=dev))
        h = torch.stack([r.draft_hidden for r in rs])
        toks = torch.tensor([r.all_token_ids[-1] for r in rs], device=dev)
        logits, g = self.head(h, toks, meta, cache, self.backend, self.block_size)
        self._expand(states, list(range(len(states))), [[-1] for _ in states], logits, depth=1)
        prev_g = g
        # ---- steps 1..num_steps-1: expand each request's frontier ----
        for i in range(1, max(st.shape.num_steps for st in states)):
            active = [k for k, st in enumerate(states) if st.shape.num_steps > i]
            if not active:
                break
            q_tokens, q_hidden_rows, slots, positions, cache_index = [], [], [], [], []
            query_start, ctx, masks, owners, who = [0], [], [], [], []
            for k in active:
                st = states[k]
                r, nk, tk = st.req, st.req.num_tokens, st.shape.topk
                depth_i = [c for c, cd in enumerate(st.cands) if cd.depth == i]
                depth_i.sort(key=lambda c: -st.cands[c].score)
                st.frontier = depth_i[:tk]
                ctx_len = nk + i * tk
                m = torch.zeros(len(st.frontier), ctx_len, dtype=torch.bool)
                m[:, 1:nk] = True
                for row, c in enumerate(st.frontier):
                    cd = st.cands[c]
                    cd.slot = nk + (i - 1) * tk + row
                    a = c
                    while a >= 0:
                        m[row, st.cands[a].slot] = True
                        a = st.cands[a].parent
                    q_tokens.append(cd.token)
                    q_hidden_rows.append(cd.hidden_row)
                    slots.append(self.slot(r, cd.slot))
                    positions.append(nk - 2 + i)
                    cache_index.append(cd.slot)
                    who.append(c)
                query_start.append(len(q_tokens))
                ctx.append(ctx_len)
                masks.append(m.to(dev))
                owners.append(k)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots, device=dev), query_start=query_start, context_lens=ctx,
                kv_start=[1] * len(owners), cache_index=torch.tensor(cache_index, device=dev),
                block_tables=self.block_tables([states[k].req for k in owners]), custom_masks=masks,
                positions=torch.tensor(positions, device=dev))
            h = prev_g[torch.tensor(q_hidden_rows, device=dev)]
            logits, g = self.head(h, torch.tensor(q_tokens, device=dev), meta, cache, self.backend, self.block_size)
            parents = [who[query_start[j]:query_start[j + 1]] for j in range(len(owners))]
            self._expand(states, owners, parents, logits, depth=i + 1, row_offsets=query_start)
            prev_g = g
        return [self._select(st) for st in states]

    def _expand(self, states, owners, parents, logits, depth, row_offsets=None):
        """Add the top-k children of each query row as candidates (hidden_row = that row)."""
        logp = torch.log_softmax(logits, dim=-1)
        kmax = max(states[k].shape.topk for k in owners)
        top = logp.topk(kmax, dim=-1)
        ids = self.head.to_target_ids(top.indices).tolist()
        vals = top.values.tolist()
        for j, k in enumerate(owners):
            st = states[k]
            base = j if row_offsets is None else row_offsets[j]
            for q, parent in enumerate(parents[j]):
                row = base + q
                pscore = st.cands[parent].score if parent >= 0 else 0.0
                for t in range(st.shape.topk):
                    st.cands.append(_Cand(ids[row][t], pscore + vals[row][t], parent, depth, hidden_row=row))

    @staticmethod
    def _select(st: _ReqState) -> DraftTree:
        n_keep = st.shape.num_draft_tokens - 1
        order = sorted(range(len(st.cands)), key=lambda c: (-st.cands[c].score, st.cands[c].depth, c))
        keep = sorted(order[:n_keep], key=lambda c: (st.cands[c].depth, -st.cands[c].score, c))
        index = {c: i + 1 for i, c in enumerate(keep)}
        tokens = [st.req.all_token_ids[-1]] + [st.cands[c].token for c in keep]
        parents = [-1] + [index.get(st.cands[c].parent, 0) if st.cands[c].parent >= 0 else 0 for c in keep]
        depths = [0] + [st.cands[c].depth for c in keep]
        return DraftTree(tokens, parents, depths)
