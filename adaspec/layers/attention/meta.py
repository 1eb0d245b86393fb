"""Attention metadata: everything a paged-attention kernel needs for one forward, as device
tensors, prepared once per forward (never per layer).

A forward's tokens are flattened (varlen): request b owns query rows
`query_start[b] : query_start[b+1]` (possibly zero rows). Every request owns one row of the
persistent block table (`block_table[req_row[b]]`, int32 block ids; slot = block * block_size
+ offset); its KV entries are indexed 0.. in sequence order ("cache index").

Visibility, for query row t of request b, key cache index j:
    kv_start[b] <= j < ctx_len[b]
    and  (j < mask_start[b] and j <= cache_index[t])                       # causal prefix
      or (j >= mask_start[b] and mask[mask_offset[b] + r * W_b + (j - mask_start[b])])
         where r = t - query_start[b] and W_b = ctx_len[b] - mask_start[b]  # tree region
    and  (window is None or j > positions[t] - window)                      # sliding window
A request without a tree has mask_start[b] = ctx_len[b] (pure causal by cache index).
A query row that sees no key gets an output of zeros (padding rows of CUDA graphs).

Writes: new K/V rows are stored at `slot_mapping[t]` before attention reads; a negative slot
means "do not write" (the position's KV already lives in a shared prefix-cache block).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttnMeta:
    # per query row [T]
    positions: torch.Tensor      # int64 rotary positions (a tree node's is its depth-based one)
    cache_index: torch.Tensor    # int32 index of the row's own KV in its sequence (causality)
    slot_mapping: torch.Tensor   # int64 flat cache slot to write the row's K/V (-1 = skip)
    # per request [B]
    query_start: torch.Tensor    # int32 [B + 1]
    ctx_len: torch.Tensor        # int32: keys 0..ctx_len-1 exist (the new rows' included)
    kv_start: torch.Tensor       # int32: first visible key (the EAGLE-3 draft skips slot 0)
    req_row: torch.Tensor        # int32: row of the request in block_table
    mask_start: torch.Tensor     # int32: first key of the tree region (= ctx_len: none)
    mask_offset: torch.Tensor    # int32: offset of the request's first mask row in `mask`
    # shared
    block_table: torch.Tensor    # int32 [R, W] persistent block table (rows of live requests)
    mask: torch.Tensor           # uint8 flat tree masks (at least one element)
    # Triton launch plan: program p handles rows query_start[prog_req[p]] + prog_q0[p] ...
    # + block_q - 1 of request prog_req[p] (rows past the request's end are ignored).
    prog_req: torch.Tensor       # int32 [P]
    prog_q0: torch.Tensor        # int32 [P]
    block_q: int                 # query rows per program (a power of two)
    block_size: int              # tokens per KV block
    max_ctx_len: int             # host-side upper bound of ctx_len (reference: padding; Triton: split-KV)
    max_q_len: int               # host-side upper bound of rows per request
    num_splits: int | None = None   # Triton split-KV programs per query block, fixed (None: chosen per launch)

    @property
    def num_reqs(self) -> int:
        return self.ctx_len.shape[0]


def launch_plan(q_lens, block_q: int):
    """(prog_req, prog_q0) as int32 numpy arrays: one program per `block_q` query rows of each
    request with at least one row."""
    import numpy as np

    if isinstance(q_lens, list) and q_lens and q_lens[0] > 0 and q_lens.count(q_lens[0]) == len(q_lens):
        # A uniform batch (decodes, verification, every CUDA graph's): no per-request arithmetic.
        B, m = len(q_lens), -(-q_lens[0] // block_q)
        if m == 1:
            return np.arange(B, dtype=np.int32), np.zeros(B, dtype=np.int32)
        return (np.repeat(np.arange(B, dtype=np.int32), m),
                np.tile(np.arange(0, m * block_q, block_q, dtype=np.int32), B))
    q_lens = np.asarray(q_lens, dtype=np.int64)
    nprog = (q_lens + block_q - 1) // block_q
    prog_req = np.repeat(np.arange(len(q_lens), dtype=np.int32), nprog)
    first = np.cumsum(nprog) - nprog
    prog_q0 = ((np.arange(int(nprog.sum())) - np.repeat(first, nprog)) * block_q).astype(np.int32)
    return prog_req, prog_q0
