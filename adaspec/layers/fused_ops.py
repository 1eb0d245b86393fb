"""Fused elementwise ops of the decoder layer: RMSNorm (+ residual add), SiLU-and-mul, and
rotary + KV-cache store. One Triton kernel each on CUDA; elsewhere a PyTorch reference that
reproduces models/llama.py (and so Hugging Face) bit for bit.

Path selection (`use_triton`): the Triton kernel when the tensor is on CUDA, or when
ADASPEC_TRITON_INTERPRET=1 (tests: the Triton interpreter on CPU); otherwise the reference.
The Triton kernels replay HF's rounding steps (every bf16 op of the unfused code rounds once),
so on bf16 they agree with the reference up to the order of the fp32 sums of the norm.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from adaspec.layers.attention.torch_ref import torch_store_kv
from adaspec.layers.rotary import apply_rotary
from adaspec.layers import pdl

if os.environ.get("ADASPEC_TRITON_INTERPRET") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated (below)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the references serve
    triton = None


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or os.environ.get("ADASPEC_TRITON_INTERPRET") == "1")


# Heads per program of the rotary kernel: one while the grid stays small (latency), a block of
# 8 past ROTARY_ONE_HEAD_MAX_PROGRAMS programs (a program per head is launch-bound at verify sizes).
ROTARY_HEADS_PER_PROGRAM, ROTARY_ONE_HEAD_MAX_PROGRAMS = 8, 4096


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# ----------------------------------------------------------------------------- references

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """models/llama.py RMSNorm, after the residual add the unfused code does before it."""
    if residual is not None:
        x = (x + residual).to(x.dtype)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), x


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] ([T, 2I] -> [T, I]), as models/llama.py MLP."""
    inter = x.shape[-1] // 2
    # contiguous(): CPU silu takes a vectorized path only on dense input, and its exp differs
    # from the strided path's in the last bit; HF applies silu to a dense gate_proj output.
    return F.silu(x[..., :inter].contiguous()) * x[..., inter:]


def _split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    T = qkv.shape[0]
    nq, nkv = num_heads * head_dim, num_kv_heads * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != nq + 2 * nkv:
        raise ValueError(f"rotary_qkv_store: qkv {tuple(qkv.shape)} is not [T, (Hq + 2 Hkv) * D] = "
                         f"[T, {nq + 2 * nkv}]")
    return (qkv[:, :nq].view(T, num_heads, head_dim), qkv[:, nq: nq + nkv].view(T, num_kv_heads, head_dim),
            qkv[:, nq + nkv:].view(T, num_kv_heads, head_dim))


def rotary_qkv_store_ref(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache,
                         slot_mapping, q_norm=None, k_norm=None, eps: float = 0.0) -> torch.Tensor:
    """Reference of `rotary_qkv_store` (same contract) through rms_norm_ref and rotary.apply_rotary."""
    q, k, v = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    if q_norm is not None:   # Qwen3 / GLM: each head RMS-normed before rotary
        q.copy_(rms_norm_ref(q, q_norm, eps)[0])
        k = rms_norm_ref(k, k_norm, eps)[0]
    half = cos_sin.shape[1] // 2
    cs = cos_sin[positions]
    # The table holds each frequency once; HF duplicates it ([f, f]) and rounds to the model dtype.
    cos = cs[:, :half].repeat(1, 2).to(qkv.dtype)
    sin = cs[:, half:].repeat(1, 2).to(qkv.dtype)
    q.copy_(apply_rotary(q, cos, sin))
    torch_store_kv(k_cache, v_cache, apply_rotary(k, cos, sin), v, slot_mapping)
    return q


# ----------------------------------------------------------------------------- kernels

if triton is not None:
    from adaspec.layers.pdl import gdc_enter

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                         stride_ro, H, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                         USE_GDC: tl.constexpr = False):
        gdc_enter(USE_GDC)   # programmatic dependent launch (layers/pdl.py)
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < H
        x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + c, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # HF: the add rounds to the dtype
            tl.store(res_out_ptr + row * stride_ro + c, x, mask=ok)
        h = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
        normed = (h * inv).to(x.dtype).to(tl.float32)  # HF: normed.to(input dtype), then * weight
        w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + c, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr,
                             USE_GDC: tl.constexpr = False):
        gdc_enter(USE_GDC)   # programmatic dependent launch (layers/pdl.py)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < inter
        g = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
        u = tl.load(x_ptr + row * stride_x + inter + c, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # HF: silu rounds to the dtype, then * up
        tl.store(out_ptr + row * stride_o + c, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)

    @triton.jit(do_not_specialize=["hpp"])
    def _rotary_qkv_store_kernel(qkv_ptr, pos_ptr, cs_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr,
                                 stride_t, stride_cs, stride_kc, stride_kh, stride_vc, stride_vh, eps, hpp,
                                 NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr,
                                 D_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                                 NORM: tl.constexpr, BH: tl.constexpr, USE_GDC: tl.constexpr = False):
        """Program (t, block of `hpp` <= BH heads): heads h < NUM_HEADS are q heads (rotated in place),
        the next NUM_KV are KV heads (k rotated and stored, v stored; slot < 0 skips the store).
        NORM: q and k heads are RMS-normed first (weights qn / kn [D]; per head, its inverse RMS
        from the whole head in fp32, then weight * normed.to(dtype), as `_rms_norm_kernel`
        rounds); q's normed tail (partial rotary) is stored too. `hpp` is a runtime value (one
        compiled variant serves every T): 1 for few rows (latency: a program per head), BH for
        many (a program per head was 36 one-warp programs a token, 23 us at 1,024 verify rows on
        the H200; 8 heads a program made it 10 us, and 1.6x slower at one row)."""
        gdc_enter(USE_GDC)   # programmatic dependent launch (layers/pdl.py)
        t = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, BH)
        h = tl.program_id(1) * hpp + lane
        h_ok = (h < NUM_HEADS + NUM_KV) & (lane < hpp)
        is_q = h < NUM_HEADS
        pos = tl.load(pos_ptr + t)
        i = tl.arange(0, HALF_PAD)
        i_ok = i < HALF
        d = tl.arange(0, D_PAD)
        base = qkv_ptr + t * stride_t + h[:, None].to(tl.int64) * D   # the k heads follow the q heads
        m1 = h_ok[:, None] & i_ok[None, :]
        x1 = tl.load(base + i[None, :], mask=m1, other=0.0)
        x2 = tl.load(base + HALF + i[None, :], mask=m1, other=0.0)
        ty = x1.dtype
        rest = (d >= 2 * HALF) & (d < D)   # partial rotary: the tail dims are not rotated
        xt = tl.load(base + d[None, :], mask=h_ok[:, None] & rest[None, :], other=0.0)
        if NORM:
            full = tl.load(base + d[None, :], mask=h_ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
            inv = (1.0 / tl.sqrt(tl.sum(full * full, axis=1) / D + eps))[:, None]
            w1 = tl.where(is_q[:, None], tl.load(qn_ptr + i, mask=i_ok, other=0.0)[None, :],
                          tl.load(kn_ptr + i, mask=i_ok, other=0.0)[None, :]).to(tl.float32)
            w2 = tl.where(is_q[:, None], tl.load(qn_ptr + HALF + i, mask=i_ok, other=0.0)[None, :],
                          tl.load(kn_ptr + HALF + i, mask=i_ok, other=0.0)[None, :]).to(tl.float32)
            wt = tl.where(is_q[:, None], tl.load(qn_ptr + d, mask=rest, other=0.0)[None, :],
                          tl.load(kn_ptr + d, mask=rest, other=0.0)[None, :]).to(tl.float32)
            x1 = (w1 * (x1.to(tl.float32) * inv).to(ty).to(tl.float32)).to(ty)
            x2 = (w2 * (x2.to(tl.float32) * inv).to(ty).to(tl.float32)).to(ty)
            xt = (wt * (xt.to(tl.float32) * inv).to(ty).to(tl.float32)).to(ty)
        # HF rounds cos/sin to the model dtype and rounds every product and sum once.
        c = tl.load(cs_ptr + pos * stride_cs + i, mask=i_ok, other=0.0).to(ty).to(tl.float32)[None, :]
        s = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0).to(ty).to(tl.float32)[None, :]
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        o1 = ((a1 * c).to(ty).to(tl.float32) - (a2 * s).to(ty).to(tl.float32)).to(ty)
        o2 = ((a2 * c).to(ty).to(tl.float32) + (a1 * s).to(ty).to(tl.float32)).to(ty)
        qm = m1 & is_q[:, None]
        tl.store(base + i[None, :], o1, mask=qm)
        tl.store(base + HALF + i[None, :], o2, mask=qm)
        if NORM and 2 * HALF < D:
            tl.store(base + d[None, :], xt, mask=(h_ok & is_q)[:, None] & rest[None, :])
        # KV heads: the rotated k and the v rows into the caches at the row's slot (negative:
        # the KV already lives in a shared prefix block). Broadcast the slot before comparing:
        # the interpreter rejects a scalar bool in a mask.
        kvh = (h - NUM_HEADS).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kv_ok = h_ok & (h >= NUM_HEADS) & ((kvh * 0 + slot) >= 0)
        kty = k_cache_ptr.dtype.element_ty
        kdst = k_cache_ptr + slot * stride_kc + kvh[:, None] * stride_kh
        tl.store(kdst + i[None, :], o1.to(kty), mask=kv_ok[:, None] & i_ok[None, :])
        tl.store(kdst + HALF + i[None, :], o2.to(kty), mask=kv_ok[:, None] & i_ok[None, :])
        tl.store(kdst + d[None, :], xt.to(kty), mask=kv_ok[:, None] & rest[None, :])
        v = tl.load(base + NUM_KV * D + d[None, :], mask=kv_ok[:, None] & (d < D)[None, :], other=0.0)
        vdst = v_cache_ptr + slot * stride_vc + kvh[:, None] * stride_vh
        tl.store(vdst + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=kv_ok[:, None] & (d < D)[None, :])


# ----------------------------------------------------------------------------- entry points

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual_out) for x [..., H]. With `residual`: residual_out = x + residual
    rounded to x.dtype (as the unfused HF code adds) and normed = RMSNorm(residual_out);
    without: residual_out = x. RMSNorm: fp32 math, weight * normed.to(x.dtype). New tensors;
    the inputs are not modified."""
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    if not use_triton(x):
        return rms_norm_ref(x, weight, eps, residual)
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    r2 = residual.reshape(-1, H) if residual is not None else x2
    if x2.stride(1) != 1 or r2.stride(1) != 1:
        x2, r2 = x2.contiguous(), r2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty_like(x2) if residual is not None else x2
    if x2.shape[0]:
        BLOCK = _next_pow2(H)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), H, eps,
            HAS_RES=residual is not None, BLOCK=BLOCK, num_warps=min(max(BLOCK // 256, 1), 16), **pdl.launch_kw(x2))
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(x[:, :I]) * x[:, I:] with HF's rounding (silu rounds to the
    dtype, then the product does). A new tensor."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim {x.shape[-1]} is not even ([gate | up])")
    if not use_triton(x):
        return silu_and_mul_ref(x)
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    BLOCK = min(1024, _next_pow2(inter))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, BLOCK))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=BLOCK, num_warps=4, **pdl.launch_kw(x2))
    return out.view(*x.shape[:-1], inter)


def rotary_qkv_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                     k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Neox-style ("rotate_half") rotary on q and k of a fused projection, and the KV store.
    With `q_norm` and `k_norm` ([D] weights; Qwen3, GLM's use_qk_norm) every q and k head is
    first RMS-normed over its D values (as `rms_norm` rounds, epsilon `eps`) in the same
    kernel: one launch where the separate norms took three (two norms and a concatenation).

    qkv [T, (Hq + 2 Hkv) * D] (rows may be strided, columns contiguous); positions [T] int64;
    cos_sin [max_pos, rot_dim] fp32 (`RotaryEmbedding.cos_sin_cache`; rot_dim <= D, partial rotary
    leaves the tail dims alone); caches [num_slots, Hkv, D]; slot_mapping [T] (negative: skip the store).
    Returns q [T, Hq, D]: a VIEW of qkv, rotated IN PLACE. The k part of qkv is left as it was
    (the rotated k only goes to the cache); v is copied to the cache. One kernel, no host sync.
    """
    q, k, v = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    rot = cos_sin.shape[1]
    if rot % 2 or rot > head_dim or cos_sin.dtype != torch.float32:
        raise ValueError(f"rotary_qkv_store: cos_sin {tuple(cos_sin.shape)} {cos_sin.dtype} must be fp32 "
                         f"[max_pos, rot_dim] with an even rot_dim <= head_dim {head_dim}")
    if k_cache.shape[1:] != (num_kv_heads, head_dim) or v_cache.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"rotary_qkv_store: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} are not "
                         f"[num_slots, {num_kv_heads}, {head_dim}]")
    if positions.shape != (qkv.shape[0],) or slot_mapping.shape != (qkv.shape[0],):
        raise ValueError(f"rotary_qkv_store: positions {tuple(positions.shape)} / slot_mapping "
                         f"{tuple(slot_mapping.shape)} must be [T] = [{qkv.shape[0]}]")
    if (q_norm is None) != (k_norm is None) or (q_norm is not None and (q_norm.shape != (head_dim,)
                                                                       or k_norm.shape != (head_dim,))):
        raise ValueError(f"rotary_qkv_store: q_norm and k_norm go together, each [head_dim] = [{head_dim}]")
    if not use_triton(qkv):
        return rotary_qkv_store_ref(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim,
                                    k_cache, v_cache, slot_mapping, q_norm, k_norm, eps)
    if qkv.stride(1) != 1 or cos_sin.stride(1) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("rotary_qkv_store: qkv, cos_sin and the caches need contiguous last dims")
    T = qkv.shape[0]
    if T:
        half = rot // 2
        norm = q_norm is not None
        heads = num_heads + num_kv_heads
        bh = min(ROTARY_HEADS_PER_PROGRAM, _next_pow2(heads))
        hpp = 1 if T * heads <= ROTARY_ONE_HEAD_MAX_PROGRAMS else bh
        _rotary_qkv_store_kernel[(T, triton.cdiv(heads, hpp))](
            qkv, positions, cos_sin, slot_mapping, k_cache, v_cache, q_norm if norm else qkv, k_norm if norm else qkv,
            qkv.stride(0), cos_sin.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), float(eps), hpp, NUM_HEADS=num_heads, NUM_KV=num_kv_heads, D=head_dim,
            D_PAD=_next_pow2(head_dim), HALF=half, HALF_PAD=_next_pow2(half), NORM=norm, BH=bh, num_warps=2,
            **pdl.launch_kw(qkv))
    return q
