"""Everything after the target forward, on the device: the LM head on the verify rows, the
penalized rows' processors (`adaspec.penalties`), then each grammar request's token bitmask on
its rows (`structured.bitmask`; reported logprobs stay the raw logits'), the target's choice at
every node (`sampling.choose`), verification (`spec_decode.verifier`, or simulated
acceptance in benchmarks), each request's last token and count (for the step planned before
this one is read), accepted tree KV moved into place, the draft KV refreshed.
`PostForward` is captured as is by the post CUDA graphs (greedy and simulated batches).

`verify_inputs` lays out the verify batch on the host and `stage_verify` stages it right
after the forward's metadata, in one fixed order, so a post graph finds it where its
capture staged it (the capture calls the same functions on a batch of padding requests).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaspec.device.staging import Staging
from adaspec.engine.draft_refresh import DraftRefresh, RefreshBatch, RefreshEntries, stage_refresh
from adaspec.engine.penalty_step import StagedLogprobs, StagedPenalties, stage_logprobs, stage_penalties, \
    token_logprobs
from adaspec.engine.step_plan import StepResult
from adaspec.penalties import apply_penalties, path_matrix
from adaspec.sampling import MAX_LOGPROBS, SamplingBatch, choose
from adaspec.spec_decode.simulated import simulate
from adaspec.spec_decode.verifier import verify
from adaspec.structured.bitmask import apply_bitmask, legal_drafts


@dataclass
class VerifyInputs:
    """Host arrays of the verify batch: Bv requests x N nodes."""

    rows: np.ndarray       # [Bv, N] forward rows of each node
    tokens: np.ndarray     # [Bv, N] draft tokens (filled on the device)
    parents: np.ndarray    # [Bv, N] (trees: filled on the device)
    limit: np.ndarray      # [Bv] own depth
    src: list              # [Bv] device rows


def verify_inputs(lay, pad: int, pad_row: int, rows: list[int]) -> VerifyInputs:
    """The requests that sample (`lay.verify`), then `pad` padding requests of a graph batch
    (each owns its own q = N rows; limit 0 accepts nothing)."""
    N = lay.N
    reqs = [lay.reqs[i] for i in lay.verify]
    n, Bv = len(lay.reqs), len(reqs) + pad
    # A drafting request's nodes are its root row and the N-1 draft rows after it, a chain's
    # parents each the node before; any other request verifies its root N times, parents -1.
    # Padding request e owns rows (n+e)*N ... as a chain.
    chain = np.array([L.pad > 0 for L in reqs] + [True] * pad, dtype=bool)[:, None]
    first = np.array([L.root for L in reqs] + [(n + e) * N for e in range(pad)], dtype=np.int64)
    nodes = np.arange(N, dtype=np.int64)
    return VerifyInputs(first[:, None] + nodes * chain, np.zeros((Bv, N), np.int64),
                        np.where(chain, nodes - 1, -1),
                        np.array([L.depth if L.pad else 0 for L in reqs] + [0] * pad, dtype=np.int64),
                        [rows[i] for i in lay.verify] + [pad_row] * pad)


@dataclass
class VerifyBatch:
    """The staged verify batch (device views after commit) and the step's shape."""

    rows: object
    tokens: object
    parents: object
    limit: object
    accept: object            # simulated acceptance draws [Bv, D] (None: real verification)
    src: object
    sampling: dict | None     # staged SamplingBatch arrays (None: every row greedy)
    params: list | None       # the rows' SamplingParams (host flags of the SamplingBatch)
    refresh: RefreshBatch | None
    N: int
    D: int
    tree: bool
    penalties: StagedPenalties | None = None   # penalized rows (eager post-forward only)
    logprobs: StagedLogprobs | None = None     # rows that report logprobs (eager only)
    all_logprobs: bool = False     # logprobs of every row, MAX_LOGPROBS alternatives (post graphs)
    grammar: tuple | None = None   # (bitmask [Bv*N, W] on the device, vocab size) (structured.bitmask)


def stage_verify(stg: Staging, vi: VerifyInputs, accept: np.ndarray | None, refresh: RefreshEntries | None,
                 N: int, D: int, tree: bool, params: list | None = None, seeds: list | None = None,
                 reqs: list | None = None) -> VerifyBatch:
    """Stage the post-forward inputs in one fixed order: verify rows, draft tokens, parents,
    limits, simulated draws, device rows, the draft refresh's arrays, the sampling batch,
    then (eager steps only) the penalized and logprob rows of `reqs`."""
    b = VerifyBatch(stg.add(vi.rows, torch.int64), stg.add(vi.tokens, torch.int64),
                    stg.add(vi.parents, torch.int64), stg.add(vi.limit, torch.int64),
                    stg.add(accept, torch.uint8) if accept is not None else None, stg.add(vi.src, torch.int64),
                    None, None, None, N, D, tree)
    if refresh is not None:
        b.refresh = stage_refresh(stg, refresh)
    if params is not None and not all(p.greedy for p in params):
        host = SamplingBatch.host_arrays(params, seeds)
        b.sampling = {k: stg.add(v, SamplingBatch.FIELD_DTYPES[k]) for k, v in host.items()}
        b.params = params
    if reqs:
        b.penalties = stage_penalties(stg, reqs)
        b.logprobs = stage_logprobs(stg, reqs)
    return b


class PostForward:
    """The step after the target forward (see the module docstring). Returns the step's
    output rows [Bv, count | emitted [D+1] | path [D+1] | own depth] and the logprob rows
    (`penalty_step.token_logprobs`, None when no row asks)."""

    def __init__(self, lm_head, last_token: torch.Tensor, last_count: torch.Tensor, last_emitted: torch.Tensor,
                 kv: torch.Tensor, block_table: torch.Tensor, block_size: int, refresh: DraftRefresh | None):
        self.lm_head, self.last_token, self.last_count = lm_head, last_token, last_count
        self.last_emitted = last_emitted
        self.kv, self.block_table, self.block_size, self.refresh = kv, block_table, block_size, refresh

    def __call__(self, hidden: torch.Tensor, aux: torch.Tensor | None, pos_d: torch.Tensor,
                 b: VerifyBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        vrows, src, limit = b.rows.t, b.src.t, b.limit.t
        Bv, N = vrows.shape
        raw = logits = self.lm_head(hidden[vrows.reshape(-1)]).view(Bv * N, -1)
        if b.penalties is not None:
            logits = self.penalize(raw, b, src)
        if b.grammar is not None:   # after the penalties, before every choice: drafts, bonus and
            if logits is raw and (b.logprobs is not None or b.all_logprobs):   # plain tokens obey
                logits = raw.clone()                                          # it; logprobs stay raw
            apply_bitmask(logits, *b.grammar)
        sampling = None
        if b.sampling is not None:
            sampling = SamplingBatch.of(b.params, [], logits.device, {k: r.t for k, r in b.sampling.items()})
            sampling = sampling.repeat(N)
        # The token each node's choice stands for is at the node's position + 1.
        choice = choose(logits, sampling, pos_d[vrows.reshape(-1)] + 1).view(Bv, N)
        parents = b.parents.t if b.tree else None
        if b.accept is not None:
            legal = None
            if b.grammar is not None:   # simulated acceptance keeps grammar outputs legal
                legal = legal_drafts(b.grammar[0], b.tokens.t, parents)
            path, emitted, count = simulate(b.tokens.t, parents, limit, choice, b.accept.t.bool(), b.D, legal)
        else:
            path, emitted, count = verify(b.tokens.t, parents, limit, choice, b.D)
        lp = None
        if b.logprobs is not None:
            r = b.logprobs.rows.t
            lp = token_logprobs(raw, N, path[r], emitted[r], b.logprobs.k, reqs=r)
        elif b.all_logprobs:
            lp = token_logprobs(raw, N, path, emitted, MAX_LOGPROBS)
        self.last_token[src] = emitted.gather(1, (count - 1).unsqueeze(1)).squeeze(1)
        self.last_count[src] = count
        self.last_emitted[src, :emitted.shape[1]] = emitted
        if b.tree:
            self.move_tree_kv(pos_d[vrows[:, 0]], src, path, count)
        if b.refresh is not None:
            self.refresh.run(b.refresh, aux, path, emitted, count)
        return torch.cat([count.unsqueeze(1), emitted, path, limit.unsqueeze(1)], dim=1), lp

    def penalize(self, raw: torch.Tensor, b: VerifyBatch, src: torch.Tensor) -> torch.Tensor:
        """The logits with the penalized rows processed (`adaspec.penalties`); read before this
        step overwrites its rows' last emitted tokens."""
        pb = b.penalties.batch()
        Bv, N = b.rows.t.shape
        P = pb.rows.shape[0]
        parents = b.parents.t[pb.rows] if b.tree else None
        anc = path_matrix(parents, P, N, b.D, raw.device)
        rsrc = src[pb.rows]
        view = raw.view(Bv, N, -1)
        done = apply_penalties(view[pb.rows], pb, b.tokens.t[pb.rows], anc, self.last_emitted[rsrc],
                               self.last_count[rsrc])
        out = view.float().clone()
        out[pb.rows] = done
        return out.view(Bv * N, -1)

    def move_tree_kv(self, base: torch.Tensor, rows: torch.Tensor, path: torch.Tensor, count: torch.Tensor) -> None:
        """Accepted node path[d] was written at cache index base+path[d] (base [B] = the
        root's, n-1); its committed place is base+d. One gather/scatter over every layer's K
        and V; `rows` [B] are the requests' device rows."""
        D = path.shape[1] - 1
        if D == 0:
            return
        bs = self.block_size
        d = torch.arange(1, D + 1, device=path.device)
        src_idx = base.unsqueeze(1) + path[:, 1:]
        dst_idx = base.unsqueeze(1) + d.unsqueeze(0)
        move = (d.unsqueeze(0) < count.unsqueeze(1)) & (path[:, 1:] != d.unsqueeze(0))
        src_idx = torch.where(move, src_idx, dst_idx)
        table = self.block_table[rows].long()

        def slot(idx):
            return table.gather(1, idx // bs) * bs + idx % bs

        src, dst = slot(src_idx).reshape(-1), slot(dst_idx).reshape(-1)
        self.kv[:, :, dst] = self.kv[:, :, src]


def read_out_rows(out: torch.Tensor, lay, results: list) -> None:
    """Fill the StepResults of the verify rows from the host copy of PostForward's output
    rows, [count | emitted (D + 1) | accepted path (D) | tree depth] each (`lay`: the step's
    StepLayout, whose `verify` names the request of each row)."""
    D = lay.D
    for row, i in zip(out.tolist(), lay.verify):
        cnt, L = row[0], lay.reqs[i]
        results[i] = StepResult(emitted=row[1:1 + cnt], num_accepted=cnt - 1,
                                tree_depth=row[-1] if L.pad else 0, tree_nodes=L.nodes if L.pad else 0,
                                path=row[2 + D: 2 + D + cnt - 1])
