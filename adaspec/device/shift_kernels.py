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

The index arrays come packed in one int64 array, counts first (`HEADER`), and the kernel reads
the counts on the device: a launch sized for the most entries a step can have is the same
launch every step, which a CUDA graph captures (the chain draft graph applies the shift of the
steps it drafts for: `device.chain_steps`).
"""
from __future__ import annotations

import torch

from adaspec.layers.fused_ops import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["stride_bt"])
    def _shift_kernel(v64_ptr, v32_ptr, packed_ptr, last_count_ptr, block_table_ptr, stride_bt,
                      BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
        n64 = tl.load(packed_ptr)
        n32 = tl.load(packed_ptr + 1)
        ns = tl.load(packed_ptr + 2)
        e64_ptr = packed_ptr + 3   # past the counts (HEADER)
        e32_ptr = e64_ptr + 2 * n64
        s_ptr = e32_ptr + 2 * n32
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


BLOCK = 256
HEADER = 3   # n64, n32, ns: the packed shift's counts (device.shift.Shift.stage)


def shift_apply(v64: torch.Tensor, v32: torch.Tensor, packed: torch.Tensor, max_entries: int,
                last_count: torch.Tensor, block_table: torch.Tensor, block_size: int) -> bool:
    """Apply a packed shift (its counts read on the device, at most `max_entries` of each
    part) to the staging buffer's int64 / int32 views with the kernel; False (nothing done)
    where it does not run (no Triton, or a CPU tensor outside the interpreter). Graph-safe:
    the launch depends on `max_entries` only, not on the counts."""
    if not use_triton(packed):
        return False
    if max_entries > 0:
        _shift_kernel[(triton.cdiv(max_entries, BLOCK),)](
            v64, v32, packed, last_count, block_table, block_table.stride(0), BLOCK_SIZE=block_size, BLOCK=BLOCK)
    return True


def warm_up(last_count: torch.Tensor, block_table: torch.Tensor, block_size: int) -> bool:
    """Compile the kernel before serving (it first runs in the first overlapped speculative
    step otherwise): one launch on a scratch buffer, with the engine's own `last_count` and
    block table (the row registered is the last one, the padding row: delta 0)."""
    dev = last_count.device
    buf = torch.full((64,), 0xFF, dtype=torch.uint8, device=dev)   # int64 elements read -1
    row = last_count.shape[0] - 1
    packed = torch.tensor([1, 1, 1, 0, row, 0, row, 1, 0, row], dtype=torch.int64, device=dev)
    return shift_apply(buf.view(torch.int64), buf.view(torch.int32), packed, 1, last_count, block_table, block_size)
