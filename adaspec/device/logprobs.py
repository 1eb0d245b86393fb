"""Log-probabilities of chosen rows of the logits, in one pass over the vocabulary.

    logprob_rows(logits, rows, targets, k) -> [R, 1 + 2k] float32
        for each chosen row rows[i] of `logits` [M, V] (raw target logits): the log-probability
        of targets[i], then the k largest log-probabilities and their token ids (as floats,
        exact below 2**24)

On CUDA (or under the Triton interpreter, ADASPEC_TRITON_INTERPRET=1) one kernel reads each
chosen row once, in chunks of the vocabulary, and writes per chunk its maximum, its sum of
exponentials and its `TOP` largest entries; a few small PyTorch ops merge the chunks. The
PyTorch path (elsewhere) picks the rows, converts them to float32, takes logsumexp and topk:
five passes over [R, V] and a copy of it, measured at +0.67 ms per step at b = 64 with chain 3
on the H200 (+6.7%) against a plain step.

Top-k inside a chunk sorts 64-bit keys: the float32 logit mapped to an order-preserving
integer in the high half, (2**31 - 1 - token id) in the low half, so equal logits list the
smaller id first. Log-probabilities are logit - logsumexp, as in the PyTorch path; the two
differ only in the order of the float32 sums of the logsumexp.
"""
from __future__ import annotations

import torch

from adaspec.layers.fused_ops import _next_pow2, triton, use_triton

TOP = 32          # candidates a chunk keeps (a power of two >= MAX_LOGPROBS)
BLOCK_V = 4096    # vocabulary entries per program
_LOW = 0x7FFFFFFF

if triton is not None:
    import triton.language as tl

    # tl.topk appeared in Triton 3.2; before it, a chunk is sorted whole and its first TOP kept.
    _HAS_TOPK = hasattr(tl, "topk")

    @triton.jit(do_not_specialize=["stride", "V", "C"])
    def _chunk_kernel(logits_ptr, rows_ptr, stride, V, C, max_ptr, sum_ptr, key_ptr,
                      BLOCK: tl.constexpr, K: tl.constexpr, WITH_TOP: tl.constexpr, USE_TOPK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        row = tl.load(rows_ptr + r)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = offs < V
        x = tl.load(logits_ptr + row * stride + offs, mask=m, other=float("-inf")).to(tl.float32)
        mx = tl.max(x, 0)
        safe = tl.where(mx == float("-inf"), 0.0, mx)   # a chunk of -inf logits sums to 0, not NaN
        tl.store(max_ptr + r * C + c, mx)
        tl.store(sum_ptr + r * C + c, tl.sum(tl.exp(x - safe), 0))
        if WITH_TOP:
            b = x.to(tl.int32, bitcast=True)
            o = b ^ ((b >> 31) & 0x7FFFFFFF)          # float order as int32 order
            key = (o.to(tl.int64) << 32) | (0x7FFFFFFF - offs).to(tl.int64)
            base = key_ptr + (r * C + c) * K
            if USE_TOPK:
                tl.store(base + tl.arange(0, K), tl.topk(key, K))
            else:
                j = tl.arange(0, BLOCK)
                tl.store(base + j, tl.sort(key, descending=True), mask=j < K)
else:
    _HAS_TOPK = False


def _decode(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logits, int64 token ids) of packed keys."""
    o = (keys >> 32).to(torch.int32)
    bits = o ^ ((o >> 31) & _LOW)
    return bits.view(torch.float32), _LOW - (keys & 0xFFFFFFFF)


def logprob_rows_torch(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """The PyTorch path: the rows picked, then float32 logsumexp and topk on the raw logits."""
    sel = logits.index_select(0, rows)
    lse = torch.logsumexp(sel.float(), dim=-1, keepdim=True)
    own = sel.gather(-1, targets.unsqueeze(-1)).float() - lse
    if k == 0:
        return own
    top = sel.topk(k, dim=-1)
    return torch.cat([own, top.values.float() - lse, top.indices.float()], dim=-1)


def logprob_rows(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """[R, 1 + 2k] float32 (see the module docstring). `logits` [M, V] with unit stride along
    V; `rows`, `targets` [R] int64 on its device; 0 <= k <= TOP. Capturable in a CUDA graph."""
    if not use_triton(logits) or logits.stride(-1) != 1 or k > TOP or logits.shape[-1] < TOP:
        return logprob_rows_torch(logits, rows, targets, k)
    R, V = rows.numel(), logits.shape[-1]
    if R == 0:
        return logits.new_zeros(0, 1 + 2 * k, dtype=torch.float32)
    block = max(TOP, min(BLOCK_V, _next_pow2(V)))
    C = triton.cdiv(V, block)
    dev = logits.device
    mx = torch.empty(R, C, dtype=torch.float32, device=dev)
    sm = torch.empty(R, C, dtype=torch.float32, device=dev)
    keys = torch.empty(R, C * TOP if k else 1, dtype=torch.int64, device=dev)
    _chunk_kernel[(R, C)](logits, rows, logits.stride(0), V, C, mx, sm, keys, BLOCK=block, K=TOP,
                          WITH_TOP=k > 0, USE_TOPK=_HAS_TOPK, num_warps=8 if block >= 2048 else 4)
    top = mx.max(dim=-1, keepdim=True).values
    lse = top + (sm * torch.exp(mx - top)).sum(-1, keepdim=True).log()
    own = logits[rows, targets].float().unsqueeze(1) - lse
    if k == 0:
        return own
    vals, ids = _decode(keys.topk(k, dim=-1).values)
    return torch.cat([own, vals - lse, ids.float()], dim=-1)
