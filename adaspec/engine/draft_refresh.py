"""The draft-KV refresh: the draft's own KV cache never goes stale.

Every step, the pair (hidden_p, token_{p+1}) of every position p a refreshing request's rows
cover is written to draft slot p+1 (EAGLE-3: hidden_p = the head's projection of the target's
aux features at p). A request refreshes when it may speculate in the step
(`ScheduledRequest.refresh`); one that may not gets no entry at all, and its rows of a later
step re-run the positions it missed (catch-up rows, see scheduler.py). For a speculating
request the pairs of its accepted drafts are known only on the device, after verification:
its entries name a draft depth, and the device resolves row, token and validity from the
verifier's path and count. A pair whose token is still on the device (the last token of a
request whose previous step is in flight, one row before its last) is filled there
(`fill_at`/`fill_from`, before the forward, as the forward's own input ids are).

A post CUDA graph replays a fixed layout (1 + D entries per request): there a request that
does not refresh gets entries that write nothing, and a step in which no request refreshes
replays a post graph without the refresh (runner: `post_graph(..., refresh=False)`).

`refresh_entries` lays the entries out on the host, `stage_refresh` stages them (one field
per array), `DraftRefresh.run` writes the draft KV and each request's last draft hidden.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaspec.device.shift import Shift
from adaspec.device.staging import Staging, stage_forward
from adaspec.layers.attention import ForwardContext, forward_context

ENTRY_FIELDS = ("base", "depth", "vreq", "emitted_at", "token", "position", "slot")


@dataclass
class RefreshEntries:
    """Host arrays, one entry per refreshed pair (R) and one per request."""

    table: np.ndarray       # [7, R] the ENTRY_FIELDS rows below, in that order (staged in one copy)
    base: np.ndarray        # [R] forward row of the pair's hidden (a draft's: the root's row)
    depth: np.ndarray       # [R] draft depth of the pair (0: a committed row)
    vreq: np.ndarray        # [R] the request's verify index
    emitted_at: np.ndarray  # [R] column of the emitted token that follows (-1: known on the host)
    token: np.ndarray       # [R] that token, when known on the host
    position: np.ndarray    # [R] rotary position p
    slot: np.ndarray        # [R] draft KV slot of cache index p + 1 (-1: write nothing)
    last: np.ndarray        # [2, B] entry of each request's last pair | verify index adding count-1
    rows: list              # [B] device rows (padding: the pad row)
    q_lens: list            # entries per request
    moved: list             # entries of requests whose previous step is in flight
    moved_rows: list
    fill_at: list           # entries whose token is still on the device ...
    fill_from: list         # ... and the device row whose last token it is


@dataclass
class RefreshBatch:
    """The staged entries (device views after commit) and, for draft heads of more than one
    layer, the attention metadata of the refresh forward."""

    fields: dict            # ENTRY_FIELDS -> staged ref
    last: object
    rows: object
    meta: object = None


def refresh_entries(sched, lay, D: int | None, pad: int, N: int, pad_row: int, block_size: int
                    ) -> RefreshEntries | None:
    """Entries of the step's pairs, for the requests that refresh. A speculating request has
    one entry per accepted draft up to its own depth, or up to D when D is given (a post
    graph's fixed layout: entries past the accepted length write nothing, and a request that
    does not refresh gets 1 + D entries that write nothing, its `last` into the pad row);
    `pad` padding requests (of a graph batch, q = N rows each) add entries that write nothing.
    None when nothing is refreshed."""
    if sched and not any(s.refresh for s in sched):
        return None
    cols = [[] for _ in ENTRY_FIELDS]
    base, dsel, vreq, emj, htok, dpos, dslot = cols
    last, lastadd, q_lens, moved, moved_rows, rows = [], [], [], [], [], []
    fill_at, fill_from = [], []
    bs = block_size
    for s, L in zip(sched, lay):
        r = s.req
        if not s.refresh:
            if D is not None:   # a post graph's layout: write nothing (row `vi` of a 1-row request)
                for col, v in zip(cols, (L.row0, 0, max(L.vi, 0), -1, 0, 0, -1)):
                    col.extend([v] * (1 + D))
                last.append(len(base) - 1)
                lastadd.append(-1)
                rows.append(pad_row)
            continue
        c, n, blocks, toks = s.start, r.num_tokens, r.block_ids, r.all_token_ids
        vi = max(L.vi, 0)
        first = len(base)
        for j in range(L.n_new):
            p = c + j
            known = p + 1 < n
            base.append(L.row0 + j)
            dsel.append(0)
            vreq.append(vi)
            emj.append(-1 if known else 0)
            if p + 1 < len(toks) or not known:
                htok.append(toks[p + 1] if known else 0)
            else:   # the token of the request's last row, still on the device
                htok.append(0)
                fill_at.append(len(base) - 1)
                fill_from.append(r.row)
            dpos.append(p)
            dslot.append(blocks[(p + 1) // bs] * bs + (p + 1) % bs)
        if L.pad:   # the pairs of accepted drafts (depth d: position n-1+d), one column at a time
            depth = L.depth if D is None else D
            ds = range(1, depth + 1)
            base.extend([L.root] * depth)
            dsel.extend(ds)
            vreq.extend([L.vi] * depth)
            emj.extend(ds)
            htok.extend([0] * depth)
            dpos.extend(range(n, n + depth))
            own = min(depth, L.depth)   # past its own depth: write nothing
            dslot.extend([blocks[p // bs] * bs + p % bs for p in range(n + 1, n + 1 + own)])
            dslot.extend([-1] * (depth - own))
            last.append(len(base) - 1 - depth)
            lastadd.append(L.vi)
        else:
            last.append(len(base) - 1)
            lastadd.append(-1)
        q_lens.append(len(base) - first)
        rows.append(r.row)
        if r.pending:
            moved.extend(range(first, len(base)))
            moved_rows.extend([r.row] * (len(base) - first))
    for e in range(pad):   # write nothing; `last` lands in the padding's own row
        vi = len(sched) + e
        for col, v in zip(cols, (vi * N, 0, vi, -1, 0, 0, -1)):
            col.extend([v] * (1 + (D or 0)))
        last.append(len(base) - 1)
        lastadd.append(-1)
        rows.append(pad_row)
    if not base:
        return None
    table = np.array(cols, dtype=np.int64)
    return RefreshEntries(table, *table, last=np.array([last, lastadd], dtype=np.int64), rows=rows, q_lens=q_lens,
                          moved=moved, moved_rows=moved_rows, fill_at=fill_at, fill_from=fill_from)


def stage_refresh(stg: Staging, e: RefreshEntries) -> RefreshBatch:
    # One field per row of the table, each 16-byte aligned: a kernel given a row of one packed
    # [7, R] block (the positions, to the draft's rotary) would compile a variant per R mod 2.
    fields = dict(zip(ENTRY_FIELDS, stg.add_rows(e.table, torch.int64)))
    return RefreshBatch(fields, stg.add(e.last, torch.int64), stg.add(e.rows, torch.int64))


def stage_refresh_meta(stg: Staging, batch: RefreshBatch, e: RefreshEntries, shift: Shift | None,
                       num_layers: int, backend, block_table: torch.Tensor, block_size: int, group: int) -> None:
    """Register the entries of in-flight requests with the shift and, for draft heads of more
    than one layer, stage the attention metadata of the refresh forward."""
    if shift is not None and e.moved:   # the slot is that of position + 1
        idx = np.asarray(e.moved, dtype=np.int64)
        shift.add(batch.fields["position"], idx, e.moved_rows)
        shift.add_slots(batch.fields["slot"], idx, e.position[idx] + 1, e.moved_rows)
    if num_layers > 1:
        # Layers above the first attend: each request's pairs form a causal run of rows at
        # cache indices p + 1 (rows past the accepted length write nothing and no valid row
        # sees them). (No post graph: its steps are never padded.)
        ends = np.cumsum(e.q_lens)
        batch.meta, _, _ = stage_forward(
            stg, backend, block_table, block_size, group, q_lens=e.q_lens, ctx_len=e.position[ends - 1] + 2,
            kv_start=[1] * len(e.q_lens), req_row=e.rows[: len(e.q_lens)], positions=e.position,
            cache_index=e.position + 1, slots=e.slot)


class DraftRefresh:
    """Writes the refreshed pairs into the draft KV cache on the device (captured inside the
    post graphs). `draft_hidden` [rows, H]: each request's last draft hidden state."""

    def __init__(self, head, backend, cache: list, draft_hidden: torch.Tensor):
        self.head, self.backend, self.cache, self.draft_hidden = head, backend, cache, draft_hidden

    def run(self, batch: RefreshBatch, aux: torch.Tensor, path=None, emitted=None, count=None) -> None:
        """`path`/`emitted`/`count`: the verifier's outputs (None when nothing was verified)."""
        f = {k: v.t for k, v in batch.fields.items()}
        last, lastadd = batch.last.t
        row, tok, slot = f["base"], f["token"], f["slot"]
        if path is not None:
            dsel, vreq, emj = f["depth"], f["vreq"], f["emitted_at"]
            row = row + torch.where(dsel > 0, path[vreq, dsel.clamp(max=path.shape[1] - 1)], 0)
            tok = torch.where(emj >= 0, emitted[vreq, emj.clamp(min=0)], tok)
            valid = (emj < 0) | (emj < count[vreq])
            slot = torch.where(valid, slot, torch.full_like(slot, -1))
            last = last + torch.where(lastadd >= 0, count[lastadd.clamp(min=0)] - 1, 0)
        h = self.head.project(aux[row])
        if batch.meta is None:
            self.head.write_kv(h, tok, f["position"], self.cache, slot)
        else:
            batch.meta.slot_mapping.copy_(slot)
            with forward_context(ForwardContext(batch.meta, self.backend, self.cache)):
                self.head.write_kv(h, tok, f["position"], self.cache, slot)
        self.draft_hidden[batch.rows.t] = h[last]
