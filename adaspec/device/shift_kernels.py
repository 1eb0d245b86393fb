"""The Triton kernel of `device.shift.Shift.apply` (CUDA): the in-flight position shift in one
launch instead of about fifteen PyTorch ops per staging buffer (indexing, casts, clones: a launch
each, host time and a device gap each, every overlapped speculative step). One launch, not
two: on the H200's host the shifts of a speculative step (two staging buffers, two launches
each) took 0.22-0.25 ms (benchmarks/launch_anatomy.py), which a host-bound step pays in full.

  entries  entries[el] += last_count[row] - 1, on the int64 and the int32 view of one staging
           buffer (atomic adds: an element registered twice moves twice, as index_add_ does)
  slots    slot[el] = slot of cache index (ci + last_count[row] - 1) of device row `row`, where
           slot[el] >= 0; `ci` is the host's staged value, so no slot reads an entry that moves
           in the same launch
"""
from __future__ import annotations

import torch

from adaspec.layers.fused_ops import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["n64", "n32", "ns", "stride_bt"])
    def _shift_kernel(v64_ptr, v32_ptr, e64_ptr, n64, e32_ptr, n32, s_ptr, ns, last_count_ptr, block_table_ptr,
                      stride_bt, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
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
        m = i < ns
        el = tl.load(s_ptr + i, mask=m, other=0)
        row = tl.load(s_ptr + 2 * ns + i, mask=m, other=0)
        pos = tl.load(s_ptr + ns + i, mask=m, other=0) + tl.load(last_count_ptr + row, mask=m, other=1) - 1
        cur = tl.load(v64_ptr + el, mask=m, other=-1)
        page = tl.load(block_table_ptr + row * stride_bt + pos // BLOCK_SIZE, mask=m & (cur >= 0), other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        tl.store(v64_ptr + el, tl.where(cur >= 0, slot, cur), mask=m)


_BLOCK = 256


def shift_apply(dev: torch.Tensor, e64: torch.Tensor, e32: torch.Tensor, slots: torch.Tensor,
                last_count: torch.Tensor, block_table: torch.Tensor, block_size: int) -> bool:
    """Apply a staged shift to the byte buffer `dev` with the kernel; False (nothing done)
    where it does not run (no Triton, or a CPU tensor outside the interpreter). e64 / e32:
    [2, n] (element, device row); slots: [3, n] (slot element, cache index, device row)."""
    if not use_triton(dev):
        return False
    n = max(e64.shape[1], e32.shape[1], slots.shape[1])
    if n:
        _shift_kernel[(triton.cdiv(n, _BLOCK),)](
            dev.view(torch.int64), dev.view(torch.int32), e64, e64.shape[1], e32, e32.shape[1], slots, slots.shape[1],
            last_count, block_table, block_table.stride(0), BLOCK_SIZE=block_size, BLOCK=_BLOCK)
    return True


def warm_up(last_count: torch.Tensor, block_table: torch.Tensor, block_size: int) -> bool:
    """Compile the kernel before serving (it first runs in the first overlapped speculative
    step otherwise): one launch on a scratch buffer, with the engine's own `last_count` and
    block table (the row registered is the last one, the padding row: delta 0)."""
    dev = last_count.device
    buf = torch.full((64,), 0xFF, dtype=torch.uint8, device=dev)   # int64 elements read -1
    row = last_count.shape[0] - 1
    e = torch.tensor([[0], [row]], dtype=torch.int64, device=dev)
    slots = torch.tensor([[1], [0], [row]], dtype=torch.int64, device=dev)
    return shift_apply(buf, e, e, slots, last_count, block_table, block_size)
