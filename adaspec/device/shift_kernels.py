"""Triton kernels of `device.shift.Shift.apply` (CUDA): the in-flight position shift in two
launches instead of about fifteen PyTorch ops per staging buffer (indexing, casts, clones: a
launch each, host time and a device gap each, every overlapped speculative step).

  shift_entries  entries[el] += last_count[row] - 1, on the int64 and the int32 view of one
                 staging buffer (atomic adds: an element registered twice moves twice, as
                 index_add_ does)
  shift_slots    slot[el] = slot of cache index (v64[pos_el] + off) of device row `row`,
                 where slot[el] >= 0 (runs after shift_entries: it reads shifted positions)
"""
from __future__ import annotations

import torch

from adaspec.layers.fused_ops import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["n64", "n32"])
    def _shift_entries_kernel(v64_ptr, v32_ptr, e64_ptr, n64, e32_ptr, n32, last_count_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m64 = i < n64
        el = tl.load(e64_ptr + i, mask=m64, other=0)
        row = tl.load(e64_ptr + n64 + i, mask=m64, other=0)
        d = tl.load(last_count_ptr + row, mask=m64, other=1) - 1
        tl.atomic_add(v64_ptr + el, d, mask=m64)
        m32 = i < n32
        el = tl.load(e32_ptr + i, mask=m32, other=0)
        row = tl.load(e32_ptr + n32 + i, mask=m32, other=0)
        d = tl.load(last_count_ptr + row, mask=m32, other=1) - 1
        tl.atomic_add(v32_ptr + el, d.to(tl.int32), mask=m32)

    @triton.jit(do_not_specialize=["n", "stride_bt"])
    def _shift_slots_kernel(v64_ptr, s_ptr, n, block_table_ptr, stride_bt, BLOCK_SIZE: tl.constexpr,
                            BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        el = tl.load(s_ptr + i, mask=m, other=0)
        pos = tl.load(v64_ptr + tl.load(s_ptr + n + i, mask=m, other=0), mask=m, other=0) \
            + tl.load(s_ptr + 2 * n + i, mask=m, other=0)
        row = tl.load(s_ptr + 3 * n + i, mask=m, other=0)
        cur = tl.load(v64_ptr + el, mask=m, other=-1)
        page = tl.load(block_table_ptr + row * stride_bt + pos // BLOCK_SIZE, mask=m & (cur >= 0), other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        tl.store(v64_ptr + el, tl.where(cur >= 0, slot, cur), mask=m)


_BLOCK = 256


def shift_apply(dev: torch.Tensor, e64: torch.Tensor, e32: torch.Tensor, slots: torch.Tensor,
                last_count: torch.Tensor, block_table: torch.Tensor, block_size: int) -> bool:
    """Apply a staged shift to the byte buffer `dev` with the kernels; False (nothing done)
    where they do not run (no Triton, or a CPU tensor outside the interpreter). e64 / e32:
    [2, n] (element, device row); slots: [4, n] (slot element, position element, offset, row)."""
    if not use_triton(dev):
        return False
    v64, v32 = dev.view(torch.int64), dev.view(torch.int32)
    n = max(e64.shape[1], e32.shape[1])
    if n:
        _shift_entries_kernel[(triton.cdiv(n, _BLOCK),)](v64, v32, e64, e64.shape[1], e32, e32.shape[1], last_count,
                                                         BLOCK=_BLOCK)
    if slots.shape[1]:
        _shift_slots_kernel[(triton.cdiv(slots.shape[1], _BLOCK),)](
            v64, slots, slots.shape[1], block_table, block_table.stride(0), BLOCK_SIZE=block_size, BLOCK=_BLOCK)
    return True


def warm_up(last_count: torch.Tensor, block_table: torch.Tensor, block_size: int) -> bool:
    """Compile both kernels before serving (they first run in the first overlapped speculative
    step otherwise): one launch each on a scratch buffer, with the engine's own `last_count`
    and block table (the row registered is the last one, the padding row: delta 0)."""
    dev = last_count.device
    buf = torch.full((64,), 0xFF, dtype=torch.uint8, device=dev)   # int64 elements read -1
    row = last_count.shape[0] - 1
    e = torch.tensor([[0], [row]], dtype=torch.int64, device=dev)
    slots = torch.tensor([[1], [2], [0], [row]], dtype=torch.int64, device=dev)
    return shift_apply(buf, e, e, slots, last_count, block_table, block_size)
