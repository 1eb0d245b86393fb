"""Reference paged-attention backend in plain PyTorch (the CPU path, and the oracle the Triton
kernels are tested against).

Vectorized over the batch: each request's pages are gathered into a padded [B, S] context,
its query rows into a padded [B, Q] block, and one `scaled_dot_product_attention` call runs
with an explicit boolean mask built from `AttnMeta` (see meta.py for the visibility rules).
Host reads: `meta.max_ctx_len` / `meta.max_q_len` (host ints) and at most one device->host
read per call (whether any request carries a tree mask; whether any slot is skipped).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adaspec.layers.attention.meta import AttnMeta


def torch_store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write k[t], v[t] ([T, Hkv, D]) into the flat caches ([num_slots, Hkv, D]) at
    slot_mapping[t]; rows with a negative slot are skipped (their KV already lives in a shared
    prefix-cache block)."""
    if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0] or k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not match cache rows {tuple(k_cache.shape[1:])}")
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):  # the one host read: rare (prefix hits, graph padding)
        idx = keep.nonzero().squeeze(1)
        slots, k, v = slots[idx], k[idx], v[idx]
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def visibility_mask(meta: AttnMeta, S: int, Q: int, has_tree: bool = True):
    """(mask [B, Q, S] bool, row_b [T], row_r [T], row_ok [T]): which cache index each padded
    query row (request b, row r of it) may attend to, exactly the AttnMeta rules. Rows outside
    every request (row_ok False) see nothing."""
    dev = meta.ctx_len.device
    T = meta.positions.shape[0]
    B = meta.num_reqs
    qs = meta.query_start.long()
    t = torch.arange(T, device=dev)
    # Request of each row: the last b with query_start[b] <= t (requests may own zero rows).
    row_b = torch.searchsorted(qs[1:], t, right=True).clamp_(max=max(B - 1, 0))
    row_r = t - qs[row_b]
    row_ok = (t >= qs[0]) & (t < qs[-1]) & (row_r < Q)
    row_r = torch.where(row_ok, row_r, torch.zeros_like(row_r))

    def padded(x, fill=0):  # [T] per-row values -> [B, Q]
        out = torch.full((B, Q), fill, dtype=torch.long, device=dev)
        out[row_b[row_ok], row_r[row_ok]] = x.long()[row_ok]
        return out

    ci = padded(meta.cache_index, -1)            # padding rows: causally see nothing
    valid = padded(torch.ones_like(t), 0).bool()
    j = torch.arange(S, device=dev).view(1, 1, S)
    col = lambda x: x.long().view(B, 1, 1)  # noqa: E731
    ctx, ms = col(meta.ctx_len), col(meta.mask_start)
    mask = (j >= col(meta.kv_start)) & (j < ctx) & valid.unsqueeze(-1)
    vis = (j < ms) & (j <= ci.unsqueeze(-1))
    if has_tree:
        width = ctx - ms                                   # W_b (0 without a tree)
        r = torch.arange(Q, device=dev).view(1, Q, 1)
        idx = col(meta.mask_offset) + r * width + (j - ms)
        in_tree = (j >= ms) & (j < ctx) & valid.unsqueeze(-1)
        idx = torch.where(in_tree, idx, torch.zeros_like(idx)).clamp_(max=meta.mask.numel() - 1)
        vis |= in_tree & meta.mask.view(-1)[idx].bool()
    return mask & vis, row_b, row_r, row_ok


def torch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttnMeta, scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the paged caches k_cache/v_cache [num_slots, Hkv, D]
    (Hq a multiple of Hkv; q head h reads KV head h // (Hq / Hkv)). Returns [T, Hq, D] in
    q.dtype; a row that sees no key (or belongs to no request) gets zeros. `window`: a key at
    cache index j is visible from a row at rotary position p only if j > p - window."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if Hq % Hkv or k_cache.shape[2] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"attention: q {tuple(q.shape)} vs caches {tuple(k_cache.shape)}/"
                         f"{tuple(v_cache.shape)}: need Hq % Hkv == 0 and equal head dims")
    if meta.positions.shape[0] != T or meta.cache_index.shape[0] != T:
        raise ValueError(f"attention: q has {T} rows but the metadata's per-row tensors "
                         f"{meta.positions.shape[0]} / {meta.cache_index.shape[0]}")
    B, bs = meta.num_reqs, meta.block_size
    if T == 0 or B == 0:
        return q.new_zeros(T, Hq, D)
    dev = q.device
    nb = min(-(-max(meta.max_ctx_len, 1) // bs), meta.block_table.shape[1])
    S, Q = nb * bs, max(meta.max_q_len, 1)
    has_tree = bool((meta.mask_start < meta.ctx_len).any())  # skips the mask gather when False
    mask, row_b, row_r, row_ok = visibility_mask(meta, S, Q, has_tree)
    if window is not None:
        pos = torch.zeros(B, Q, dtype=torch.long, device=dev)
        pos[row_b[row_ok], row_r[row_ok]] = meta.positions.long()[row_ok]
        mask &= torch.arange(S, device=dev).view(1, 1, S) > pos.unsqueeze(-1) - window
    # Gather pages: slot = block * block_size + offset. Keys outside [kv_start, ctx_len) are
    # read from slot 0 and zeroed: their table entries and cache contents may be garbage
    # (even NaN), and a NaN value times a zero weight would still poison the row.
    j = torch.arange(S, device=dev).view(1, S)
    key_ok = (j >= meta.kv_start.long().view(B, 1)) & (j < meta.ctx_len.long().view(B, 1))
    tables = meta.block_table[meta.req_row.long(), :nb].long()
    slots = (tables.unsqueeze(-1) * bs + torch.arange(bs, device=dev)).reshape(B, S)
    slots = torch.where(key_ok, slots, torch.zeros_like(slots))
    zero = q.new_zeros(())
    k = torch.where(key_ok.view(B, S, 1, 1), k_cache[slots].to(q.dtype), zero)  # [B, S, Hkv, D]
    v = torch.where(key_ok.view(B, S, 1, 1), v_cache[slots].to(q.dtype), zero)
    qp = q.new_zeros(B, Q, Hq, D)
    qp[row_b[row_ok], row_r[row_ok]] = q[row_ok]
    seen = mask.any(-1)  # [B, Q]
    mask[..., 0] |= ~seen  # SDPA needs one visible key per row; those rows are zeroed below
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.unsqueeze(1),
        scale=scale, enable_gqa=Hq != Hkv).transpose(1, 2)  # [B, Q, Hq, D]
    out = torch.where(seen.view(B, Q, 1, 1), out, zero)
    return torch.where(row_ok.view(T, 1, 1), out[row_b, row_r], zero)
