"""Reference paged attention in plain PyTorch (temporary lead copy; superseded by kernels branch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adaspec.layers.attention.meta import AttnMeta


def torch_store_kv(k_cache, v_cache, k, v, slot_mapping):
    idx = (slot_mapping >= 0).nonzero().squeeze(1)
    k_cache.index_copy_(0, slot_mapping[idx], k[idx].to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping[idx], v[idx].to(v_cache.dtype))


def torch_paged_attention(q, k_cache, v_cache, meta: AttnMeta, scale, window=None):
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    B = meta.num_reqs
    dev = q.device
    S = max(1, meta.max_ctx_len)
    bs = meta.block_size
    nb = (S + bs - 1) // bs
    tables = meta.block_table[meta.req_row.long()][:, :nb].long()
    slots = (tables.unsqueeze(-1) * bs + torch.arange(bs, device=dev)).reshape(B, -1)[:, :S]
    k = k_cache[slots]
    v = v_cache[slots]
    qs = meta.query_start.long()
    q_lens = qs[1:] - qs[:-1]
    Q = max(1, meta.max_q_len)
    row_b = torch.repeat_interleave(torch.arange(B, device=dev), q_lens, output_size=T)
    row_q = torch.arange(T, device=dev) - qs[:-1][row_b]
    qp = q.new_zeros(B, Q, Hq, D)
    qp[row_b, row_q] = q
    ci = torch.zeros(B, Q, dtype=torch.long, device=dev)
    ci[row_b, row_q] = meta.cache_index.long()
    j = torch.arange(S, device=dev).view(1, 1, S)
    ctx = meta.ctx_len.long().view(B, 1, 1)
    ms = meta.mask_start.long().view(B, 1, 1)
    mask = ((j < ctx) & (j >= meta.kv_start.long().view(B, 1, 1))).expand(B, Q, S).clone()
    causal = (j <= ci.unsqueeze(-1)) & (j < ms)
    # tree region
    W = (ctx - ms).clamp(min=0)
    r = torch.arange(Q, device=dev).view(1, Q, 1)
    idx = meta.mask_offset.long().view(B, 1, 1) + r * W + (j - ms)
    in_tree = (j >= ms) & (j < ctx) & (r < q_lens.view(B, 1, 1))
    tree = torch.zeros(B, Q, S, dtype=torch.bool, device=dev)
    in_tree = in_tree.expand(B, Q, S)
    idx = idx.expand(B, Q, S)
    if bool(in_tree.any()):
        tree[in_tree] = meta.mask[idx[in_tree]].bool()
    mask &= causal | tree
    if window is not None:
        pos = torch.zeros(B, Q, dtype=torch.long, device=dev)
        pos[row_b, row_q] = meta.positions.long()
        mask &= j > pos.unsqueeze(-1) - window
    valid = torch.zeros(B, Q, dtype=torch.bool, device=dev)
    valid[row_b, row_q] = True
    mask &= valid.unsqueeze(-1)
    seen = mask.any(-1)
    mask[..., 0] |= ~seen
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), k.transpose(1, 2).to(q.dtype),
                                         v.transpose(1, 2).to(q.dtype), attn_mask=mask.unsqueeze(1),
                                         scale=scale, enable_gqa=(Hq != Hkv))
    out = out.transpose(1, 2) * seen.unsqueeze(-1).unsqueeze(-1)
    return out[row_b, row_q]
