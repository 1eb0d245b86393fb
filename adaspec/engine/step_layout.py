"""The host layout of one step's target forward: which query rows each scheduled request owns,
what every row feeds (token, position, cache index, KV slot), and the attention metadata
per request. Pure host code over the plan; `stage_forward_inputs` puts it in the step's
staging buffer. CUDA-graph capture builds its dummy batches with the same functions
(`ForwardInputs.padding`), so a replayed graph reads the addresses a step fills.

Row layout: request i owns `n_new` committed rows (catch-up rows first, see
scheduler.ScheduledRequest: positions below `write_from` write no target KV); in a speculative step every decoding
request also owns N-1 draft rows (N = the step's tree size), padded when its own budget is
smaller (padding rows write no KV and are never accepted), so decode and verify batches
stay uniform and graph-friendly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from adaspec.device.shift import Shift
from adaspec.device.staging import FixedLaunch, Staging, stage_forward
from adaspec.engine.step_plan import StepPlan


@dataclass
class RequestLayout:
    """One scheduled request's rows in the target forward."""

    row0: int          # first query row
    n_new: int         # committed rows (catch-up rows included)
    pad: int           # draft rows (N - 1 when the request is verified, else 0)
    depth: int         # its own draft depth (0 = not speculating)
    nodes: int         # its own draft nodes
    vi: int            # index in the verify batch (-1: does not sample this step)

    @property
    def root(self) -> int:
        """Row of its last committed token (the root of its draft)."""
        return self.row0 + self.n_new - 1


@dataclass
class StepLayout:
    """Where every scheduled request sits in the step (indices are into `plan.scheduled`)."""

    reqs: list[RequestLayout]
    N: int                 # nodes verified per sampling request, root included (1: no drafts)
    D: int                 # deepest path verification may accept (a tree is num_steps deep)
    tree: bool             # the drafts are trees (topk > 1), else chains or none
    verify: list[int]      # requests that sample, in verify order
    drafting: list[int]    # requests that draft this step (a draft and draft rows)
    shifted: list[int]     # requests whose previous step is in flight (positions shifted)

    @property
    def chain(self) -> bool:
        return bool(self.drafting) and not self.tree


def layout_step(plan: StepPlan, prev_speculative: bool) -> StepLayout:
    sched = plan.scheduled
    spec = [i for i, s in enumerate(sched) if s.draft is not None]
    topk = max((sched[i].draft.topk for i in spec), default=1)
    tree = bool(spec) and topk > 1
    if not spec:
        N = 1
    elif not tree:
        N = 1 + max(sched[i].draft.num_steps for i in spec)
    else:
        N = max(sched[i].draft.num_draft_tokens for i in spec)
    D = max(sched[i].draft.num_steps for i in spec) if tree else N - 1
    reqs: list[RequestLayout] = []
    t = nv = 0
    for s in sched:
        decoding = s.samples and s.num_rows == 1
        pad = N - 1 if (decoding and spec) else 0
        d = s.draft   # a tree's depth is known on the device only: its budget bounds it
        reqs.append(RequestLayout(t, s.num_rows, pad, d.num_steps if d is not None else 0,
                                  d.num_nodes if d is not None else 0, nv if s.samples else -1))
        nv += s.samples
        t += s.num_rows + pad
    # Requests whose previous step is in flight and may have emitted more than one token:
    # their positions are corrected on the device (device.shift.Shift).
    shifted = [i for i, s in enumerate(sched) if s.req.pending] if prev_speculative else []
    return StepLayout(reqs, N, D, tree, [i for i, L in enumerate(reqs) if L.vi >= 0],
                      [i for i in spec if reqs[i].pad], shifted)


@dataclass
class ForwardInputs:
    """Host arrays of the target forward: per query row (ids .. slots) and per request."""

    ids: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    cache_index: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    q_lens: list = field(default_factory=list)
    ctx: list = field(default_factory=list)
    mask_start: list = field(default_factory=list)
    mask_offset: list = field(default_factory=list)
    mask: list = field(default_factory=list)          # per tree request, N*N uint8 each
    fill_at: list = field(default_factory=list)       # rows whose token is still on the device
    fill_from: list = field(default_factory=list)     # ... and the device row that holds it
    tree_offsets: list = field(default_factory=list)  # mask offset of each drafting tree

    def pad(self, extra: int, q: int, tree: bool) -> None:
        """Add `extra` padding requests of q rows: no keys, no KV writes (a graph's batch)."""
        self.ids += [0] * (extra * q)
        self.positions += [0] * (extra * q)
        self.cache_index += [0] * (extra * q)
        self.slots += [-1] * (extra * q)
        self.q_lens += [q] * extra
        self.ctx += [0] * extra
        self.mask_start += [0] * extra
        self.mask_offset += [0] * extra
        if tree:
            self.mask += [np.zeros(q * q, np.uint8)] * extra

    def pad_to(self, rows: int, slots: int) -> None:
        """Fill the shape of a token graph of `rows` rows in `slots` request slots
        (`CudaGraphs.lookup`): a padding request owns the rows past the step's (it sees no key,
        writes no KV and has no tree), then requests of no rows fill the slots; the last of them
        owns the padding programs of the graph's attention launch plan (`FixedLaunch`)."""
        n = rows - sum(self.q_lens)
        if n < 0 or len(self.q_lens) + 2 > slots:
            raise ValueError(f"a step of {sum(self.q_lens)} rows and {len(self.q_lens)} requests does not fit a "
                             f"token graph of {rows} rows and {slots} slots")
        self.pad(1, n, False)
        self.pad(slots - len(self.q_lens), 0, False)

    @classmethod
    def padding(cls, b: int, q: int, tree: bool) -> "ForwardInputs":
        """A batch of b padding requests (what CUDA graphs are captured on)."""
        fi = cls()
        fi.pad(b, q, tree)
        return fi


def forward_inputs(plan: StepPlan, lay: StepLayout, rows: list[int], block_size: int) -> ForwardInputs:
    """The target forward's rows for `plan` (`rows`: each request's device row). Plain lists,
    one append per row: per-request numpy calls cost more than the arithmetic at large batches."""
    fi = ForwardInputs()
    ids, pos, cidx, slots = fi.ids, fi.positions, fi.cache_index, fi.slots
    N, tree, bs = lay.N, lay.tree, block_size
    moffset = 0
    for i, (s, L) in enumerate(zip(plan.scheduled, lay.reqs)):
        r, c, nn, wf = s.req, s.start, L.n_new, s.write_from
        blocks, toks = r.block_ids, r.all_token_ids
        if nn == 1:
            ids.append(toks[c] if c < len(toks) else 0)
            pos.append(c)
            cidx.append(c)
            slots.append(blocks[c // bs] * bs + c % bs if c >= wf else -1)
        else:
            ids.extend(toks[c:c + nn])
            rng = range(c, c + nn)
            pos.extend(rng)
            cidx.extend(rng)
            slots.extend([blocks[p // bs] * bs + p % bs if p >= wf else -1 for p in rng])
        if c + nn > len(toks):   # its last token is still on the device (overlap): filled there
            if nn > 1:
                ids.append(0)
            fi.fill_at.append(L.row0 + nn - 1)
            fi.fill_from.append(rows[i])
        fi.q_lens.append(nn + L.pad)
        if L.pad == 0:
            fi.ctx.append(c + nn)
            fi.mask_start.append(c + nn)
            fi.mask_offset.append(0)
            continue
        n = r.num_tokens  # root = token n-1 at cache index n-1; draft node j at n-1+j
        cidx.extend(range(n, n - 1 + N))
        ids.extend([0] * (N - 1))     # drafted on the device
        written = L.nodes if tree else L.depth
        if tree:   # positions n-1+depth and the mask come from the drafted trees
            pos.extend([n - 1] * (N - 1))
        else:
            pos.extend(range(n, n - 1 + N))
        slots.extend([blocks[p // bs] * bs + p % bs for p in range(n, n + written)])
        slots.extend([-1] * (N - 1 - written))
        if tree:   # tree region = the N nodes, root included; drafted trees fill theirs
            m = np.zeros(N * N, dtype=np.uint8)
            m[0] = 1
            fi.mask.append(m)
            if s.draft is not None:
                fi.tree_offsets.append(moffset)
            fi.ctx.append(n - 1 + N)
            fi.mask_start.append(n - 1)
            fi.mask_offset.append(moffset)
            moffset += N * N
        else:      # chain: causal by cache index; the request's own depth bounds its keys
            fi.ctx.append(n + L.depth)
            fi.mask_start.append(n + L.depth)
            fi.mask_offset.append(0)
    return fi


def stage_forward_inputs(stg: Staging, backend, block_table: torch.Tensor, block_size: int, group: int,
                         fi: ForwardInputs, tree: bool, req_row: list[int], max_ctx_len: int,
                         shift: Shift | None = None, shift_rows=None, shift_reqs=None,
                         launch: FixedLaunch | None = None):
    """Stage the target forward (always the first thing a step stages: graphs read it at
    fixed addresses); returns (AttnMeta, input ids, positions) as device views. `launch`:
    a token graph's attention launch plan (`stage_forward`)."""
    return stage_forward(
        stg, backend, block_table, block_size, group, q_lens=fi.q_lens, ctx_len=fi.ctx, kv_start=0,
        req_row=req_row, positions=fi.positions, cache_index=fi.cache_index, slots=fi.slots, input_ids=fi.ids,
        mask_start=fi.mask_start if tree else None, mask_offset=fi.mask_offset if tree else None,
        mask=np.concatenate(fi.mask) if fi.mask else None, max_ctx_len=max_ctx_len,
        shift=shift, shift_rows=shift_rows, shift_reqs=shift_reqs, launch=launch)


def shifted_rows(lay: StepLayout, rows: list[int]) -> tuple[tuple[list, list], tuple[list, list]]:
    """((query rows, device rows), (request indices, device rows)) of the shifted requests."""
    qrows, drows = [], []
    for i in lay.shifted:
        L = lay.reqs[i]
        n = L.n_new + L.pad
        qrows.extend(range(L.row0, L.row0 + n))
        drows.extend([rows[i]] * n)
    return (qrows, drows), (lay.shifted, [rows[i] for i in lay.shifted])
