"""Compile every Triton kernel of the fast path for a GPU target without a GPU (Triton's
ahead-of-time path: ASTSource -> cubin through the ptxas bundled with the wheel), over the
shapes the engine uses. Catches what the CPU interpreter cannot: unsupported constructs,
dot shapes, shared-memory overflows.

    python benchmarks/kernels/compile_check.py [--arch 90]

Run without TRITON_INTERPRET / ADASPEC_TRITON_INTERPRET (they replace the kernels by their
interpreted versions).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("ADASPEC_TRITON_INTERPRET") == "1":
    sys.exit("compile_check: unset TRITON_INTERPRET / ADASPEC_TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from adaspec.device import shift_kernels  # noqa: E402
from adaspec.layers import fused_ops  # noqa: E402
from adaspec.layers.attention import triton_kernels as tk  # noqa: E402

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
        torch.int64: "*i64", torch.uint8: "*u8"}


def compile_kernel(kernel, target, args: dict, num_warps=4, num_stages=2):
    """args: every parameter of `kernel` by name: a dtype (pointer), int, float, or
    ("constexpr", value); a constexpr left out takes its default (USE_GDC: on, as the GPU
    launches them, layers/pdl.py)."""
    sig, consts, attrs = {}, {}, {}
    defaults = {p.name: p.default for p in kernel.params if p.has_default}
    for i, name in enumerate(kernel.arg_names):
        a = args.get(name, ("c", True) if name == "USE_GDC" else ("c", defaults.get(name)))
        if isinstance(a, tuple):
            sig[name], consts[name] = "constexpr", a[1]
        elif isinstance(a, torch.dtype):
            sig[name] = _PTR[a]
            attrs[(i,)] = [["tt.divisibility", 16]]  # as the JIT specializes aligned tensors
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if a % 16 == 0:  # the JIT specializes ints divisible by 16 (strides, head dims)
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})


def resource_usage(compiled) -> str:
    """Registers / stack (spills) per thread of a compiled kernel, via the cuobjdump bundled
    with Triton's NVIDIA backend ("" when it is not there)."""
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "REG:" in line:
            fields = dict(x.split(":") for x in line.split() if x.startswith(("REG:", "STACK:")))
            return f"{fields.get('REG')} regs, stack {fields.get('STACK')} B"
    return ""


def attention_args(dtype, G, D, block_q, split, window):
    """Kernel arguments and the launch's (num_warps, num_stages), as triton_paged_attention
    chooses them."""
    GP = tk._next_pow2(G)
    BLOCK_M = max(tk.MIN_BLOCK_M, block_q * GP)
    D_PAD = max(16, tk._next_pow2(D))
    block_n, num_warps, num_stages = tk.launch_config(BLOCK_M, D_PAD)
    i32, i64 = torch.int32, torch.int64
    a = dict(q_ptr=dtype, k_ptr=dtype, v_ptr=dtype, out_ptr=dtype, ws_acc_ptr=torch.float32,
             ws_ml_ptr=torch.float32, positions_ptr=i64, cache_index_ptr=i32, query_start_ptr=i32,
             ctx_len_ptr=i32, kv_start_ptr=i32, req_row_ptr=i32, mask_start_ptr=i32, mask_offset_ptr=i32,
             block_table_ptr=i32, mask_ptr=torch.uint8, prog_req_ptr=i32, prog_q0_ptr=i32,
             scale_log2=0.1)
    for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot",
              "stride_oh", "stride_bt"):
        a[n] = 16 * D  # multiples of 16 elements: what the engine's tensors have
    for n in ("num_rows", "num_q_heads", "window", "num_splits"):
        a[n] = 7
    a.update(BLOCK_SIZE=("c", 16), G=("c", G), GP=("c", GP), BLOCK_Q=("c", block_q), BLOCK_M=("c", BLOCK_M),
             BLOCK_N=("c", block_n), D=("c", D), D_PAD=("c", D_PAD),
             HAS_WINDOW=("c", window), SPLIT=("c", split),
             DOT_PREC=("c", "ieee" if dtype == torch.float32 else "tf32"), DOT_F32=("c", False))
    return a, (num_warps, num_stages)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    bf16, f32 = torch.bfloat16, torch.float32
    cases = [  # (dtype, G, D, block_q, split, window)
        (bf16, 4, 128, 1, False, False),   # Llama-8B decode
        (bf16, 4, 128, 1, True, False),    # decode, split-KV
        (bf16, 4, 128, 4, False, False),   # verify q=4
        (bf16, 4, 128, 16, False, True),   # verify q=16 / prefill, sliding window
        (bf16, 1, 128, 64, False, False),  # MHA prefill
        (bf16, 8, 256, 8, False, False),   # head_dim 256
        (bf16, 3, 80, 4, True, True),      # odd group and head dim
        (f32, 4, 64, 4, False, False),     # fp32: ieee products
    ]
    ok = True
    for dtype, G, D, bq, split, window in cases:
        a, (nw, ns) = attention_args(dtype, G, D, bq, split, window)
        what = f"attention {str(dtype)[6:]} G={G} D={D} block_q={bq} split={split} window={window}"
        try:
            c = compile_kernel(tk._paged_attn_kernel, target, a, num_warps=nw, num_stages=ns)
            print(f"ok   {what}: shared {c.metadata.shared} B, {nw} warps, {resource_usage(c)}")
            if split:
                r = {k: a[k] for k in ("G", "GP", "BLOCK_Q", "BLOCK_M", "D", "D_PAD")}
                r.update(out_ptr=dtype, ws_acc_ptr=f32, ws_ml_ptr=f32, query_start_ptr=torch.int32,
                         prog_req_ptr=torch.int32, prog_q0_ptr=torch.int32, stride_ot=7, stride_oh=7,
                         num_rows=7, num_q_heads=7, num_splits=7)
                compile_kernel(tk._split_reduce_kernel, target, r, num_warps=nw)
                print(f"ok   split reduce for {what}")
        except Exception as e:  # report all, fail at the end
            ok = False
            print(f"FAIL {what}: {type(e).__name__}: {str(e)[:2000]}")
    simple = [
        ("store_kv bf16 Hkv=8 D=128", tk._store_kv_kernel, dict(
            k_ptr=bf16, v_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16, slot_ptr=torch.int64,
            stride_kt=128, stride_kh=128, stride_vt=128, stride_vh=128, stride_ct=128, stride_ch=128,
            stride_vct=128, stride_vch=128, HKV=("c", 8), HKV_PAD=("c", 8), D=("c", 128), D_PAD=("c", 128))),
        ("rms_norm bf16 H=4096 residual", fused_ops._rms_norm_kernel, dict(
            x_ptr=bf16, res_ptr=bf16, w_ptr=bf16, out_ptr=bf16, res_out_ptr=bf16, stride_x=4096, stride_r=4096,
            stride_o=4096, stride_ro=4096, H=4096, eps=1e-5, HAS_RES=("c", True), BLOCK=("c", 4096), USE_GDC=("c", True))),
        ("silu_and_mul bf16", fused_ops._silu_and_mul_kernel, dict(
            x_ptr=bf16, out_ptr=bf16, stride_x=28672, stride_o=14336, inter=14336, BLOCK=("c", 1024))),
        ("rotary_qkv_store bf16 32/8x128", fused_ops._rotary_qkv_store_kernel, dict(
            qkv_ptr=bf16, pos_ptr=torch.int64, cs_ptr=f32, slot_ptr=torch.int64, k_cache_ptr=bf16,
            v_cache_ptr=bf16, stride_t=6144, stride_cs=128, stride_kc=1024, stride_kh=128, stride_vc=1024,
            stride_vh=128,
            qn_ptr=bf16, kn_ptr=bf16, eps=1e-6, hpp=8,
            NUM_HEADS=("c", 32), NUM_KV=("c", 8), D=("c", 128), D_PAD=("c", 128), HALF=("c", 64),
            HALF_PAD=("c", 64), NORM=("c", True), BH=("c", 8), USE_GDC=("c", True))),
        ("shift", shift_kernels._shift_kernel, dict(
            v64_ptr=torch.int64, v32_ptr=torch.int32, packed_ptr=torch.int64, last_count_ptr=torch.int64,
            block_table_ptr=torch.int32, stride_bt=7,
            BLOCK_SIZE=("c", 16), BLOCK=("c", 256))),
    ]
    for what, kern, a in simple:
        try:
            compile_kernel(kern, target, a, num_warps=16 if "rms" in what else 4)
            print(f"ok   {what}")
        except Exception as e:
            ok = False
            print(f"FAIL {what}: {type(e).__name__}: {str(e)[:2000]}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
