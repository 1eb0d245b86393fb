"""Triton kernels of the fast path: paged attention (decode, chunked prefill over a cached
prefix, tree/chain verification: one kernel) and the KV-cache store.

Contract shared with torch_ref.py (the oracle these kernels are tested against) and
meta.py (the visibility rules). Everything here is CUDA-graph friendly: no host sync, no
data-dependent grid (the grid is len(meta.prog_req) x Hkv [x num_splits]), no allocation
except `out` when it is not given and the split-KV workspace.

Layout: q [T, Hq, D] (any row/head strides, contiguous head dim: a view of a fused qkv
buffer is fine); k_cache / v_cache [num_slots, Hkv, D] (flat slots, slot = block *
block_size + offset); q head h reads KV head h // G with G = Hq / Hkv.

Each attention program owns `block_q` consecutive query rows of one request (the launch
plan) times the G query heads sharing one KV head: BLOCK_M = max(16, block_q * next_pow2(G))
rows of a single [BLOCK_M, D] @ [D, BLOCK_N] tensor-core product per key block, so a decode
step of a GQA model loads each KV page once for all heads of the group.
"""
from __future__ import annotations

import functools
import os

if os.environ.get("ADASPEC_TRITON_INTERPRET") == "1":
    # Triton reads this when a kernel is decorated, i.e. at import of this module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

from adaspec.layers.attention import launch_table
from adaspec.layers.attention.meta import AttnMeta
from adaspec.layers import pdl
from adaspec.layers.pdl import gdc_enter

# A tile of rows narrower than 16 cannot feed tl.dot; larger ones stay within the register
# budget of 4 warps at head_dim 128.
MIN_BLOCK_M = 16
MAX_BLOCK_M = 64
_LOG2E = 1.4426950408889634
# The interpreter's tl.dot mishandles bf16 operands: there the (already rounded) operands are
# widened to fp32 for the product. Never set on a GPU.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# Programs per KV head below which a launch leaves SMs idle (132 SMs / 8 KV heads).
MIN_PROGRAMS_PER_KV_HEAD = 16


def choose_block_q(max_q_len: int, group: int, num_reqs: int | None = None) -> int:
    """Query rows per attention program (a power of two) for requests of at most `max_q_len`
    rows and `group` = Hq / Hkv query heads per KV head: enough rows to fill a MAX_BLOCK_M
    tile, no more than the longest request needs (decode: 1; verify q=4, G=4: 4). With
    `num_reqs`, narrower tiles (down to MIN_BLOCK_M rows) while the batch gives too few
    programs: on an H200, the 16-node tree verify of one request ran in 12.3 us with 16-row
    tiles against 16.7 us with 64-row ones (benchmarks/results/h200/attention_sweep)."""
    if max_q_len < 1 or group < 1:
        raise ValueError(f"choose_block_q: need max_q_len >= 1 and group >= 1, got {max_q_len}, {group}")
    gp = _next_pow2(group)
    bq = max(1, min(_next_pow2(max_q_len), MAX_BLOCK_M // gp))
    measured = launch_table.lookup(group, None, max_q_len, num_reqs) if num_reqs is not None else None
    if measured is not None:   # the sweep's choice for this layout and batch (launch_table)
        return max(1, min(measured["block_q"], bq))
    if num_reqs is not None:
        while bq * gp > MIN_BLOCK_M and num_reqs * -(-max_q_len // bq) < MIN_PROGRAMS_PER_KV_HEAD:
            bq //= 2
    return bq


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def choose_num_splits(num_programs: int, max_ctx_len: int, device: torch.device, block_m: int = MIN_BLOCK_M) -> int:
    """Split-KV factor for a grid of `num_programs` (= len(prog_req) * Hkv): split each
    program's keys only when the grid alone leaves SMs idle (decode at small batch), into
    splits of >= 256 keys, aiming at ~2 programs per SM (H200: 132 SMs), or ~1 for tiles of
    MAX_BLOCK_M rows (the 16-node tree verify of 16 requests: 30 us with 2 splits, 36 with 4)."""
    per_sm = 1 if block_m >= MAX_BLOCK_M else 2
    want = -(-per_sm * _num_sms(device) // max(num_programs, 1))
    return max(1, min(want, max_ctx_len // 256, 32))


def token_graph_splits(rows: int, block_q: int, group: int, num_kv_heads: int, max_ctx_len: int,
                       device: torch.device) -> int:
    """Split-KV factor of a token graph of `rows` rows (engine/cuda_graph.py): what a launch of
    those rows alone would choose. Its launch plan is padded with programs that do nothing, so
    the choice from its grid would never split, and a short prompt over a long cached context
    (a chat's next turn) would read every key of a head in one program."""
    block_m = max(MIN_BLOCK_M, block_q * _next_pow2(group))
    return choose_num_splits(-(-rows // block_q) * num_kv_heads, max_ctx_len, device, block_m)


def launch_config(block_m: int, d_pad: int) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) of the attention kernel for a tile of `block_m` rows.
    Measured on an H200 (8B heads, 512 keys; benchmarks/results/h200/attention_sweep): 4 warps
    at every tile size (64-row tiles: 30 us against 51 with 8 warps at 16 requests, 88 against
    181 at 64), 3 stages keeping two key blocks in flight, 32-key blocks for 64-row tiles and
    for head dims over 128 (shared memory). An fp32 accumulator larger than 64 x 128 (head dim
    256) spills registers on 4 warps: 8 there."""
    block_n = 32 if block_m >= MAX_BLOCK_M or d_pad > 128 else 64
    return block_n, (8 if block_m * d_pad > MAX_BLOCK_M * 128 else 4), 3


# Per-step sizes are not specialized on: Triton would compile a variant per value class
# (== 1, divisible by 16) at first use, a stall of a second in the middle of serving.
@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
    positions_ptr, cache_index_ptr, query_start_ptr, ctx_len_ptr, kv_start_ptr, req_row_ptr,
    mask_start_ptr, mask_offset_ptr, block_table_ptr, mask_ptr, prog_req_ptr, prog_q0_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_bt, num_rows, num_q_heads, scale_log2, window, num_splits,
    BLOCK_SIZE: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)   # programmatic dependent launch (layers/pdl.py)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(prog_req_ptr + pid)
    q0 = tl.load(prog_q0_ptr + pid)
    qs = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - qs
    ctx = tl.load(ctx_len_ptr + b)
    ms = tl.load(mask_start_ptr + b)
    moff = tl.load(mask_offset_ptr + b)
    table = block_table_ptr + tl.load(req_row_ptr + b).to(tl.int64) * stride_bt

    # Tile row m = query row q0 + m // GP of the request, query head kvh * G + m % GP.
    m = tl.arange(0, BLOCK_M)
    r = q0 + m // GP
    g = m % GP
    row_ok = (m // GP < BLOCK_Q) & (g < G) & (r < q_len)
    t = (qs + r).to(tl.int64)
    head = kvh * G + g
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    ci = tl.load(cache_index_ptr + t, mask=row_ok, other=-1)
    in_ty = q.dtype
    dot_ty = tl.float32 if DOT_F32 else in_ty
    q = q.to(dot_ty)

    # Keys no row of the tile can see are never loaded: above the last row's cache index
    # (causal, unless a tree region follows) and below the earliest row's window.
    hi = tl.where(ms < ctx, ctx, tl.minimum(ctx, tl.max(ci, axis=0) + 1))
    lo = tl.load(kv_start_ptr + b)
    if HAS_WINDOW:
        pos = tl.load(positions_ptr + t, mask=row_ok, other=2**30).to(tl.int32)
        lo = tl.maximum(lo, tl.min(pos, axis=0) - window + 1)
    if SPLIT:  # this program's share of [lo, hi), whole key blocks each
        per = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * per
        hi = tl.minimum(hi, lo + per)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile gives exp2(-inf) = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    width = ctx - ms  # columns of the request's tree mask rows (0 without a tree)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        # One page lookup per key: keys of a block may span several (small) pages.
        page = tl.load(table + j // BLOCK_SIZE, mask=j_ok, other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE  # constexpr: shifts for 2^k pages
        # Masked keys read 0, never cache garbage. The head-dim mask only when D is padded: a
        # mask that varies along the contiguous dim defeats vectorized 16-byte loads.
        if D == D_PAD:
            kv_mask = j_ok[:, None]
        else:
            kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(dot_ty)), input_precision=DOT_PREC) * scale_log2
        vis = (j[None, :] < ms) & (j[None, :] <= ci[:, None])
        if ms < hi:  # the block may reach the tree region: read the flat mask there
            in_tree = (j[None, :] >= ms) & j_ok[None, :] & row_ok[:, None]
            tm = tl.load(mask_ptr + moff + r[:, None] * width + (j[None, :] - ms), mask=in_tree, other=0)
            vis = vis | (tm != 0)
        vis = vis & j_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            vis = vis & (j[None, :] > pos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        # P rounded to the input dtype, as flash attention does (tensor-core operands).
        acc = acc * alpha[:, None] + tl.dot(p.to(in_ty).to(dot_ty), v.to(dot_ty), input_precision=DOT_PREC)
        m_i = m_new

    if SPLIT:  # unnormalised partials; the reduce kernel merges the splits
        w = ((split * num_rows + t) * num_q_heads + head) * D
        tl.store(ws_acc_ptr + w[:, None] + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        w2 = ((split * num_rows + t) * num_q_heads + head) * 2
        tl.store(ws_ml_ptr + w2, m_i, mask=row_ok)
        tl.store(ws_ml_ptr + w2 + 1, l_i, mask=row_ok)
    else:
        o = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)  # no key: 0
        tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def _split_reduce_kernel(
    out_ptr, ws_acc_ptr, ws_ml_ptr, query_start_ptr, prog_req_ptr, prog_q0_ptr,
    stride_ot, stride_oh, num_rows, num_q_heads, num_splits,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    """Merge the split partials of the rows one attention program owns (same tiling, so rows
    outside the launch plan stay untouched here too)."""
    gdc_enter(USE_GDC)   # programmatic dependent launch (layers/pdl.py)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(prog_req_ptr + pid)
    q0 = tl.load(prog_q0_ptr + pid)
    qs = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - qs
    m = tl.arange(0, BLOCK_M)
    r = q0 + m // GP
    g = m % GP
    row_ok = (m // GP < BLOCK_Q) & (g < G) & (r < q_len)
    t = (qs + r).to(tl.int64)
    head = kvh * G + g
    d = tl.arange(0, D_PAD)
    io_mask = row_ok[:, None] & (d[None, :] < D)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile gives exp2(-inf) = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for sp in range(0, num_splits):
        w2 = ((sp * num_rows + t) * num_q_heads + head) * 2
        m_s = tl.load(ws_ml_ptr + w2, mask=row_ok, other=-1.0e30)
        l_s = tl.load(ws_ml_ptr + w2 + 1, mask=row_ok, other=0.0)
        a_s = tl.load(ws_acc_ptr + (w2 // 2 * D)[:, None] + d[None, :], mask=io_mask, other=0.0)
        m_new = tl.maximum(m_i, m_s)
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(m_s - m_new)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m_i = m_new
    o = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttnMeta, scale: float, window: int | None = None,
                           out: torch.Tensor | None = None, num_splits: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None) -> torch.Tensor:
    """Paged attention of q [T, Hq, D] over k_cache / v_cache [num_slots, Hkv, D], following
    the AttnMeta visibility rules; returns `out` [T, Hq, D] (allocated in q.dtype if None).

    Rows covered by the launch plan (meta.prog_req / prog_q0 / block_q) are written; a row
    that sees no key gets zeros; rows outside every request are left untouched.
    `num_splits`: split-KV factor (None: meta.num_splits, else `choose_num_splits` from the grid
    and meta.max_ctx_len, host ints only). Each split's key range is computed on the device, so
    any fixed value is correct for any context length (for CUDA graphs: fix it per graph).
    fp32 inputs use exact (ieee) products; bf16 / fp16 tensor-core ones with fp32 softmax.
    `block_n`, `num_warps`, `num_stages`: launch overrides for tuning (None: the defaults).
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if Hq % Hkv or k_cache.shape[2] != D or v_cache.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"attention: q {tuple(q.shape)} vs caches {tuple(k_cache.shape)}/"
                         f"{tuple(v_cache.shape)}: need Hq % Hkv == 0 and equal head dims")
    if D > 256:
        raise ValueError(f"attention: head_dim {D} > 256 is not supported by the Triton kernel")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("attention: q and the caches need a contiguous head dimension")
    block_q = meta.block_q
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"attention: meta.block_q must be a power of two, got {block_q}")
    if out is None:
        out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"attention: out {tuple(out.shape)} must be [T, Hq, D] = {tuple(q.shape)} "
                         "with a contiguous head dimension")
    P = meta.prog_req.shape[0]
    if P == 0:
        return out
    if num_splits is None:
        num_splits = meta.num_splits
    G = Hq // Hkv
    GP = _next_pow2(G)
    BLOCK_M = max(MIN_BLOCK_M, block_q * GP)
    D_PAD = max(16, _next_pow2(D))
    dn, dw, ds = launch_config(BLOCK_M, D_PAD)
    # The sweep's launch for this tile (the plan's block_q came from the same entry), for the
    # 2-byte inputs it was measured with: fp32 tiles of its key blocks can exceed shared memory.
    measured = launch_table.lookup(G, D, meta.max_q_len, meta.num_reqs) if q.element_size() == 2 else None
    if measured is not None and choose_block_q(meta.max_q_len, G, meta.num_reqs) == block_q:
        dn, dw, ds = measured["block_n"], measured["num_warps"], measured["num_stages"]
        if num_splits is None:
            num_splits = max(1, min(measured["num_splits"], meta.max_ctx_len // 128))
    if num_splits is None:
        num_splits = choose_num_splits(P * Hkv, meta.max_ctx_len, q.device, BLOCK_M)
    split = num_splits > 1
    if split:
        ws_acc = torch.empty(num_splits, T, Hq, D, dtype=torch.float32, device=q.device)
        ws_ml = torch.empty(num_splits, T, Hq, 2, dtype=torch.float32, device=q.device)
    else:
        ws_acc = ws_ml = out  # unused
    block_n, num_warps, num_stages = block_n or dn, num_warps or dw, num_stages or ds
    _paged_attn_kernel[(P, Hkv, num_splits)](
        q, k_cache, v_cache, out, ws_acc, ws_ml,
        meta.positions, meta.cache_index, meta.query_start, meta.ctx_len, meta.kv_start,
        meta.req_row, meta.mask_start, meta.mask_offset, meta.block_table, meta.mask,
        meta.prog_req, meta.prog_q0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        meta.block_table.stride(0), T, Hq, scale * _LOG2E, window or 0, num_splits,
        BLOCK_SIZE=meta.block_size, G=G, GP=GP, BLOCK_Q=block_q, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        D=D, D_PAD=D_PAD, HAS_WINDOW=window is not None, SPLIT=split,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=_INTERPRET and q.dtype != torch.float32,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_kw(q),
    )
    if split:
        _split_reduce_kernel[(P, Hkv)](
            out, ws_acc, ws_ml, meta.query_start, meta.prog_req, meta.prog_q0,
            out.stride(0), out.stride(1), T, Hq, num_splits,
            G=G, GP=GP, BLOCK_Q=block_q, BLOCK_M=BLOCK_M, D=D, D_PAD=D_PAD, num_warps=num_warps, **pdl.launch_kw(q),
        )
    return out


def warm_up(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            block_size: int, dtype: torch.dtype, windows) -> int:
    """Compile (or load from Triton's disk cache) every variant of the attention kernels that a
    forward of this layout can launch: each block_q up to the cap, with and without split-KV,
    for each window in `windows` (None: full attention). Without it, the first prefill of a
    new shape compiles its variant in the middle of serving (0.4-0.7 s stalls on an H200).
    Call it with the caches and block table the engine uses (Triton specializes on their
    strides). Returns the number of launches; nothing is read or written in the caches."""
    dev = k_cache.device
    Hkv, D = k_cache.shape[1], k_cache.shape[2]
    G = num_heads // Hkv
    # The measured table's launches too, for the 2-byte dtypes it applies to (triton_paged_attention).
    measured = launch_table.entries(G, D) if dtype.itemsize == 2 else []
    cap = max([choose_block_q(1 << 20, G)] + [e["block_q"] for e in measured])
    i32 = functools.partial(torch.zeros, dtype=torch.int32, device=dev)
    launches = 0
    bq = 1
    while bq <= cap:
        T = bq   # one request of bq rows, no keys: a launch that computes nothing
        qkv = torch.zeros(T, (num_heads + 2 * Hkv) * D, dtype=dtype, device=dev)   # q is a view, as in the model
        q = qkv[:, : num_heads * D].view(T, num_heads, D)
        qs = i32(8)
        qs[1:] = T
        meta = AttnMeta(
            positions=torch.zeros(T, dtype=torch.int64, device=dev), cache_index=i32(T),
            slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=dev), query_start=qs[:2],
            ctx_len=i32(4)[:1], kv_start=i32(4)[:1], req_row=i32(4)[:1], mask_start=i32(4)[:1],
            mask_offset=i32(4)[:1], block_table=block_table, mask=torch.zeros(16, dtype=torch.uint8, device=dev),
            prog_req=i32(4)[:1], prog_q0=i32(4)[:1], block_q=bq, block_size=block_size, max_q_len=T,
            max_ctx_len=0)
        # The heuristics' launch, and every launch the measured table holds for this tile.
        variants = {(None, None, None)} | {(e["block_n"], e["num_warps"], e["num_stages"])
                                           for e in measured if e["block_q"] == bq}
        for window in windows:
            for splits in (1, 2):
                for bn, nw, ns in variants:
                    triton_paged_attention(q, k_cache, v_cache, meta, 1.0, window, num_splits=splits, block_n=bn,
                                           num_warps=nw, num_stages=ns)
                    launches += 1
        bq *= 2
    return launches


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_ch,
                     stride_vct, stride_vch, HKV: tl.constexpr, HKV_PAD: tl.constexpr,
                     D: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, HKV_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    # slot < 0: the KV lives in a shared block. (Broadcast before comparing: the interpreter
    # rejects a scalar bool in a mask.)
    mask = (h < HKV) & (d < D) & ((h * 0 + slot) >= 0)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + slot * stride_ct + h * stride_ch + d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * stride_vct + h * stride_vch + d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def triton_store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Write k[t], v[t] ([T, Hkv, D], contiguous head dim, any row/head strides) into the flat
    caches [num_slots, Hkv, D] at slot_mapping[t]; rows with a negative slot are skipped.
    One program per row; no host sync."""
    T, Hkv, D = k.shape
    if v.shape != k.shape or k_cache.shape[1:] != (Hkv, D) or v_cache.shape[1:] != (Hkv, D) \
            or slot_mapping.shape != (T,):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not match caches {tuple(k_cache.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("store_kv: k, v and the caches need a contiguous head dimension")
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HKV=Hkv, HKV_PAD=_next_pow2(Hkv), D=D, D_PAD=_next_pow2(D), num_warps=4)
