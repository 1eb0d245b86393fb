"""GPU micro-benchmark of the paged-attention kernels (Llama-3.1-8B heads: 32 q / 8 kv, D 128,
bf16, KV block 16).

Cases: decode (1 row per request) at b = 1, 16, 64, 256 over ctx 512 and 4096; verify with a
tree mask (q = 4 and 16 rows per request) at b = 1, 16, 64 over the same contexts. Each case
times:
  triton        triton_paged_attention, eager (what a call costs, launch included)
  triton_graph  the same call replayed from a CUDA graph (kernel time only)
  torch_ref     torch_paged_attention (the CPU reference backend, run on the GPU)
  sdpa_flash    SDPA's flash backend on dense, contiguous KV of the same size (no paging,
                no tree mask: a lower bound to aim at)
and checks triton against torch_ref. Prints a table; --json writes the records.

    python benchmarks/kernels/bench_attention.py --json results/h200/attention.json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys

import numpy as np
import torch
import torch.nn.functional as F

from adaspec.engine.cuda_graph import record
from adaspec.layers.attention.meta import AttnMeta, launch_plan
from adaspec.layers.attention.torch_ref import torch_paged_attention
from adaspec.layers.attention.triton_kernels import choose_block_q, choose_num_splits, triton_paged_attention

HQ, HKV, D, BLOCK = 32, 8, 128, 16


def tree_mask(q: int) -> np.ndarray:
    """A binary-ish draft tree of q nodes (node i's parent is (i - 1) // 2): ancestors + self."""
    m = np.zeros((q, q), dtype=np.uint8)
    for i in range(q):
        if i:
            m[i] = m[(i - 1) // 2]
        m[i, i] = 1
    return m


def build(b: int, ctx: int, q: int, dev, dtype, seed=0, hq: int = HQ, hkv: int = HKV, tree: bool | None = None):
    """Caches holding b requests of ctx keys each (the last q of them the new rows), with
    shuffled pages, and the AttnMeta of one forward over them: `hq` / `hkv` query / KV heads;
    for q > 1 a tree mask over the new rows unless `tree` is False (a chain: causal)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages_per = math.ceil(ctx / BLOCK)
    num_pages = b * pages_per
    k_cache = torch.randn(num_pages * BLOCK, hkv, D, generator=g).to(dev, dtype)
    v_cache = torch.randn(num_pages * BLOCK, hkv, D, generator=g).to(dev, dtype)
    table = torch.randperm(num_pages, generator=g).view(b, pages_per).to(torch.int32)
    T = b * q
    prefix = ctx - q
    q_lens = [q] * b
    block_q = choose_block_q(q, hq // hkv, b)
    prog_req, prog_q0 = launch_plan(q_lens, block_q)
    tree = q > 1 if tree is None else tree and q > 1
    mask = np.tile(tree_mask(q).reshape(-1), b) if tree else np.zeros(1, np.uint8)
    depth = tree_mask(q).sum(1) - 1 if tree else np.arange(q)
    i32 = lambda x: torch.as_tensor(np.asarray(x), dtype=torch.int32, device=dev)  # noqa: E731
    meta = AttnMeta(
        positions=torch.as_tensor(np.tile(prefix + depth, b), dtype=torch.int64, device=dev),
        cache_index=i32(np.tile(prefix + np.arange(q), b)),
        slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=dev),
        query_start=i32(np.arange(b + 1) * q),
        ctx_len=i32([ctx] * b),
        kv_start=i32([0] * b),
        req_row=i32(np.arange(b)),
        mask_start=i32([prefix if tree else ctx] * b),
        mask_offset=i32(np.arange(b) * q * q if tree else [0] * b),
        block_table=table.to(dev),
        mask=torch.as_tensor(mask, device=dev),
        prog_req=torch.as_tensor(prog_req, device=dev),
        prog_q0=torch.as_tensor(prog_q0, device=dev),
        block_q=block_q, block_size=BLOCK, max_ctx_len=ctx, max_q_len=q,
    )
    qt = torch.randn(T, hq, D, generator=g).to(dev, dtype)
    return qt, k_cache, v_cache, meta


def bench(fn) -> float:
    """Median ms of fn() (CUDA events, Triton's do_bench: warm-up, L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, as the engine captures its own (warm-up first)."""
    return record(fn)[0]


def graph_us(fn, n: int = 20) -> float:
    """Microseconds per call of fn: n calls captured in one CUDA graph, best of 5 replays."""
    g = capture(lambda: [fn() for _ in range(n)])
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / n * 1e3)
    return best


def bench_graph(fn) -> float:
    """Median ms of fn() replayed from a CUDA graph (no Python, no launch gaps)."""
    return bench(capture(fn).replay)


def run_case(kind: str, b: int, ctx: int, q: int, dtype) -> dict:
    dev = torch.device("cuda")
    qt, kc, vc, meta = build(b, ctx, q, dev, dtype)
    scale = D ** -0.5
    block_m = max(16, meta.block_q * (1 << (HQ // HKV - 1).bit_length()))
    splits = choose_num_splits(len(meta.prog_req) * HKV, ctx, dev, block_m)
    rec = {"kind": kind, "b": b, "ctx": ctx, "q": q, "block_q": meta.block_q, "num_splits": splits,
           "kv_bytes": 2 * b * ctx * HKV * D * kc.element_size()}
    out = torch.empty_like(qt)

    def triton_call():
        triton_paged_attention(qt, kc, vc, meta, scale, out=out, num_splits=splits)

    def torch_call():
        torch_paged_attention(qt, kc, vc, meta, scale)

    # Dense stand-in: the same number of keys, contiguous, no paging, no tree.
    qd = qt.view(b, q, HQ, D).transpose(1, 2).contiguous()
    kd = torch.randn(b, HKV, ctx, D, device=dev, dtype=dtype)
    vd = torch.randn_like(kd)

    def sdpa_call():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)

    for name, fn in (("triton", triton_call), ("triton_graph", None), ("torch_ref", torch_call),
                     ("sdpa_flash", sdpa_call)):
        try:
            rec[name + "_ms"] = bench_graph(triton_call) if name == "triton_graph" else bench(fn)
        except Exception as e:  # keep going: one failing column must not lose the table
            rec[name + "_ms"] = None
            rec[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.synchronize()
    try:
        triton_call()
        want = torch_paged_attention(qt, kc, vc, meta, scale)
        rec["max_abs_err"] = float((out.float() - want.float()).abs().max())
    except Exception as e:
        rec["max_abs_err"] = None
        rec["check_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    best = rec.get("triton_graph_ms") or rec.get("triton_ms")
    rec["triton_GBps"] = rec["kv_bytes"] / best / 1e6 if best else None
    return rec


def fmt(x, spec="{:.4f}"):
    return "-" if x is None else spec.format(x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--quick", action="store_true", help="one decode and one verify case (smoke test)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention: needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    cases = [("decode", b, ctx, 1) for ctx in (512, 4096) for b in (1, 16, 64, 256)]
    cases += [("verify", b, ctx, q) for q in (4, 16) for ctx in (512, 4096) for b in (1, 16, 64)]
    if args.quick:
        cases = [("decode", 16, 512, 1), ("verify", 16, 512, 4)]
    records = []
    cols = ["kind", "b", "ctx", "q", "splits", "triton", "graph", "torch_ref", "sdpa", "GB/s", "max_err"]
    print(" ".join(f"{c:>9}" for c in cols))
    for kind, b, ctx, q in cases:
        r = run_case(kind, b, ctx, q, dtype)
        torch.cuda.empty_cache()  # the case's tensors died with run_case
        records.append(r)
        print(" ".join(f"{v:>9}" for v in [
            kind, b, ctx, q, r["num_splits"], fmt(r["triton_ms"]), fmt(r["triton_graph_ms"]),
            fmt(r["torch_ref_ms"]), fmt(r["sdpa_flash_ms"]), fmt(r["triton_GBps"], "{:.0f}"),
            fmt(r["max_abs_err"], "{:.1e}")]), flush=True)
        for k, v in r.items():
            if k.endswith("error"):
                print(f"          {k}: {v}")
    if args.json:
        import triton

        info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "python": platform.python_version(), "dtype": args.dtype,
                "heads": {"q": HQ, "kv": HKV, "head_dim": D, "block_size": BLOCK}, "times": "ms (median)"}
        with open(args.json, "w") as f:
            json.dump({"info": info, "records": records}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
