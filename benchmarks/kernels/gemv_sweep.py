"""The few-rows GEMV (adaspec/layers/linear.py) against F.linear (cuBLAS) on a GPU, per weight
shape and row count, with a small sweep of its launch (BN, BK, num_warps, num_stages).

Shapes: the Qwen3-30B-A3B attention projections (qkv 5120 x 2048, o 2048 x 4096) and router
(128 x 2048), the Llama-3.1-8B attention projections (6144 x 4096, 4096 x 4096) and MLP
(28672 x 4096, 4096 x 14336). Each candidate: 20 calls replayed from one CUDA graph, best of 5
replays, output checked against F.linear. Prints and writes per shape and M: cuBLAS us, the
default launch's us, the best launch and its us, and GB/s of the weight read.

    python benchmarks/kernels/gemv_sweep.py --json gemv_sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from adaspec.layers import linear as lin

SHAPES = {"moe_qkv": (5120, 2048), "moe_o": (2048, 4096), "moe_router": (128, 2048),
          "8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336)}
LAUNCHES = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (3, 4))
            if bn * bk <= 8192]


def graph_us(fn, calls: int = 20, replays: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    best = float("inf")
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / calls)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="gemv_sweep.json")
    p.add_argument("--rows", default="1,2,4")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "default_launch": lin.LAUNCH, "results": []}
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
        for M in (int(m) for m in a.rows.split(",")):
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)
            want = F.linear(x, w)
            cublas = graph_us(lambda: F.linear(x, w))
            timed = {}
            for launch in LAUNCHES:
                got = lin.gemv(x, w, None, launch)
                if not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
                    timed[launch] = None
                    continue
                timed[launch] = graph_us(lambda: lin.gemv(x, w, None, launch))
            ok = {k: v for k, v in timed.items() if v is not None}
            best = min(ok, key=ok.get)
            gb = N * K * 2 / 1e3
            row = {"shape": name, "N": N, "K": K, "M": M, "cublas_us": cublas, "default_us": timed.get(lin.LAUNCH),
                   "best_launch": best, "best_us": ok[best], "best_GBps": gb / ok[best], "cublas_GBps": gb / cublas,
                   "mismatched_launches": [k for k, v in timed.items() if v is None]}
            out["results"].append(row)
            print(f"{name} M={M}: cublas {cublas:.2f} us ({gb / cublas:.0f} GB/s), default {row['default_us']:.2f}, "
                  f"best {best} {ok[best]:.2f} us ({gb / ok[best]:.0f} GB/s)", flush=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
