"""Launch-parameter sweep of the paged-attention kernel at the engine's decode and verify
shapes (Llama-3.1-8B heads: 32 q / 8 kv, D 128, bf16, KV block 16, 512 keys + q), on a GPU.

For each (batch, q) it times every combination of block_q (rows per program), block_n (keys
per iteration), num_warps, num_stages and num_splits: 20 calls replayed from one CUDA graph,
best of 5 replays, kernel and split-reduce together. It also times the current default launch
(the heuristics in triton_kernels.py) and SDPA's flash kernel on dense KV of the same size.
Each variant is checked against the default's output. The heuristics in triton_kernels.py
come from this table.

    python benchmarks/kernels/attention_sweep.py --json attention_sweep.json [--budget-s 330]
    # the Qwen3-30B-A3B heads (32 q / 4 kv), chain verification, the table the kernel reads:
    python benchmarks/kernels/attention_sweep.py --json moe_attn.json --heads 32,4 --chain \
        --shapes 1x1,16x1,64x1,256x1,1x4,16x4,64x4,256x4 --table-out adaspec/layers/attention/attention_configs.json
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from adaspec.layers.attention import launch_table
from adaspec.layers.attention.meta import launch_plan
from adaspec.layers.attention.triton_kernels import triton_paged_attention
from bench_attention import D, HKV, HQ, build, graph_us

SHAPES = "1x16,16x16,1x4,16x4,1x1,16x1,64x16"
BLOCK_Q = {1: [1], 4: [1, 2, 4], 16: [4, 8, 16]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop sweeping after this many seconds")
    ap.add_argument("--heads", default=f"{HQ},{HKV}", help="query,KV heads (default %(default)s: Llama-3.1-8B)")
    ap.add_argument("--shapes", default=SHAPES, help="comma list of BxQ (default %(default)s)")
    ap.add_argument("--chain", action="store_true", help="q > 1 rows are a chain (causal), not a tree")
    ap.add_argument("--table-out", default=None,
                    help="merge each shape's fastest launch into this launch table (launch_table.py's format)")
    a = ap.parse_args(argv)
    hq, hkv = (int(x) for x in a.heads.split(","))
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    if any(q not in BLOCK_Q for _, q in shapes):
        raise SystemExit(f"--shapes: query lengths must be among {sorted(BLOCK_Q)} (the block_q candidates)")
    dev = torch.device("cuda")
    scale = D ** -0.5
    t0 = time.time()
    records = []
    for b, q in shapes:
        ctx = 512 + q
        qt, kc, vc, meta0 = build(b, ctx, q, dev, torch.bfloat16, hq=hq, hkv=hkv, tree=not a.chain)
        out = torch.empty_like(qt)
        qd = qt.view(b, q, hq, D).transpose(1, 2).contiguous()
        kd = torch.randn(b, hkv, ctx, D, device=dev, dtype=torch.bfloat16)
        vd = torch.randn_like(kd)

        def sdpa():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)

        try:
            t_sdpa = graph_us(sdpa)
        except Exception:  # no flash kernel for this shape
            t_sdpa = None
        triton_paged_attention(qt, kc, vc, meta0, scale, out=out)
        want = out.clone()
        t_default = graph_us(lambda: triton_paged_attention(qt, kc, vc, meta0, scale, out=out))
        rows = []
        for bq, bn, nw, ns, sp in itertools.product(BLOCK_Q[q], (32, 64, 128), (2, 4), (2, 3, 4), (1, 2, 4, 8)):
            if time.time() - t0 > a.budget_s:
                break
            pr, p0 = launch_plan([q] * b, bq)
            meta = dataclasses.replace(meta0, block_q=bq, prog_req=torch.as_tensor(pr, device=dev),
                                       prog_q0=torch.as_tensor(p0, device=dev))

            def call(meta=meta, bn=bn, nw=nw, ns=ns, sp=sp):
                triton_paged_attention(qt, kc, vc, meta, scale, out=out, num_splits=sp, block_n=bn,
                                       num_warps=nw, num_stages=ns)

            try:
                out.zero_()
                call()
                torch.cuda.synchronize()
                err = float((out.float() - want.float()).abs().max())
                rows.append((graph_us(call), bq, bn, nw, ns, sp, err))
            except Exception as ex:  # e.g. out of shared memory: not a candidate
                print(f"   skipped bq={bq} bn={bn} warps={nw} stages={ns} splits={sp}: {type(ex).__name__}")
        rows.sort()
        print(f"b={b} q={q}: sdpa {t_sdpa and round(t_sdpa, 1)} us, default {t_default:.1f} us; best:", flush=True)
        for r in rows[:6]:
            print("   %.1f us  bq=%d bn=%d warps=%d stages=%d splits=%d err=%.1e" % r, flush=True)
        if a.table_out and rows:
            us, bq, bn, nw, ns, sp, _ = rows[0]
            p = Path(a.table_out)
            table = json.loads(p.read_text()) if p.exists() else {}
            launch_table.merge_entry(table, hq // hkv, D, q, b, dict(block_q=bq, block_n=bn, num_warps=nw, num_stages=ns,
                                                                   num_splits=sp, us=round(us, 2),
                                                                   default_us=round(t_default, 2)))
            p.write_text(json.dumps(table, indent=1))
        records.append({"b": b, "q": q, "heads": [hq, hkv], "chain": a.chain, "sdpa_us": t_sdpa, "default_us": t_default,
                        "all": [dict(zip(("us", "block_q", "block_n", "warps", "stages", "splits", "err"), r))
                                for r in rows]})
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
