"""Tree drafting (topk > 1) with an EAGLE-3 head, SGLang semantics. Chains (topk = 1) are
drafted on the device without host round trips by the runner (`ModelRunner._run_chain`);
trees need a host decision per depth (which candidates form the frontier), so this drafter
reads each step's top-k back.

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

import numpy as np

from adaspec.engine.input_batch import Staging, stage_forward
from adaspec.engine.kv_cache import slot_of
from adaspec.engine.request import Request
from adaspec.layers.attention import ForwardContext, forward_context
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


class TreeDrafter:
    def __init__(self, head: Eagle3Head, backend, block_size: int, device: torch.device, group: int):
        self.head = head
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.group = group
        self.stg = Staging(1 << 20, device)

    def slot(self, req: Request, idx: int) -> int:
        return slot_of(req, idx, self.block_size)

    def _forward(self, rows, h, tokens, **kw):
        self.stg.begin()
        meta, ids, pos = stage_forward(self.stg, self.backend, rows.block_table, self.block_size, self.group,
                                       input_ids=tokens, **kw)
        self.stg.commit()
        with forward_context(ForwardContext(meta, self.backend, self.cache)):
            return self.head(h, ids, pos)

    @torch.inference_mode()
    def propose(self, reqs: list[tuple[Request, DraftShape]], hidden: torch.Tensor, cache: list,
                rows) -> list[DraftTree]:
        """`hidden` [B, H]: each request's draft hidden state at its last pair; `cache`: one
        (k, v) pair per draft layer."""
        self.cache = cache
        states = [_ReqState(r, s) for r, s in reqs]
        rs = [st.req for st in states]
        n = np.array([r.num_tokens for r in rs])
        # ---- step 0: one query per request at its last pair ----
        logits, g = self._forward(
            rows, hidden, [r.all_token_ids[-1] for r in rs], q_lens=[1] * len(rs), ctx_len=n,
            kv_start=[1] * len(rs), req_row=[r.row for r in rs], positions=n - 2, cache_index=n - 1,
            slots=[self.slot(r, k - 1) for r, k in zip(rs, n)])
        self._expand(states, list(range(len(states))), [[-1] for _ in states], logits, depth=1)
        prev_g = g
        # ---- steps 1..num_steps-1: expand each request's frontier ----
        for i in range(1, max(st.shape.num_steps for st in states)):
            active = [k for k, st in enumerate(states) if st.shape.num_steps > i]
            if not active:
                break
            q_tokens, q_hidden_rows, slots, positions, cache_index = [], [], [], [], []
            query_start, ctx, mstart, moff, masks, owners, who = [0], [], [], [], [], [], []
            off = 0
            for k in active:
                st = states[k]
                r, nk, tk = st.req, st.req.num_tokens, st.shape.topk
                depth_i = [c for c, cd in enumerate(st.cands) if cd.depth == i]
                depth_i.sort(key=lambda c: -st.cands[c].score)
                st.frontier = depth_i[:tk]
                region = i * tk   # frontier slots of steps 1..i: nk .. nk + i*tk - 1
                m = np.zeros((len(st.frontier), region), dtype=np.uint8)
                for row, c in enumerate(st.frontier):
                    cd = st.cands[c]
                    cd.slot = nk + (i - 1) * tk + row
                    a = c
                    while a >= 0:
                        if st.cands[a].slot >= nk:
                            m[row, st.cands[a].slot - nk] = 1
                        a = st.cands[a].parent
                    q_tokens.append(cd.token)
                    q_hidden_rows.append(cd.hidden_row)
                    slots.append(self.slot(r, cd.slot))
                    positions.append(nk - 2 + i)
                    cache_index.append(cd.slot)
                    who.append(c)
                query_start.append(len(q_tokens))
                ctx.append(nk + region)
                mstart.append(nk)
                moff.append(off)
                off += m.size
                masks.append(m.reshape(-1))
                owners.append(k)
            h = prev_g[torch.tensor(q_hidden_rows, device=self.device)]
            logits, g = self._forward(
                rows, h, q_tokens, q_lens=np.diff(query_start), ctx_len=ctx, kv_start=[1] * len(owners),
                req_row=[states[k].req.row for k in owners], positions=positions, cache_index=cache_index,
                slots=slots, mask_start=mstart, mask_offset=moff, mask=np.concatenate(masks))
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
