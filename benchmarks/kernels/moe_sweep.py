"""Launch-parameter sweep of the fused-MoE Triton kernel (adaspec/layers/moe/triton_kernels.py)
per batch bucket, on a GPU, at the Qwen3-30B-A3B expert shape by default (E 128, H 2048, I 768,
top-8, bf16; random router logits, so the experts a batch touches are near the uniform case).

For each token count T (decode b = 1, 8, 16, 64, 256 at q = 1 and 4, and a prefill chunk) it
times every candidate launch of the path the dispatch takes there (`use_small_path`): aligned
(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), the whole expert computation (alignment,
gate/up, down, reduction), or small (gate/up BLOCK_N, BLOCK_K, DOWN_BLOCK_N, DOWN_BLOCK_K,
num_warps, num_stages: the two launches), 20 calls replayed from one CUDA graph, best of 5
replays; each candidate's output is checked against the default launch's. Near the small
path's limit (pairs <= 4 x SMALL_MAX_PAIRS) the other path's default launch is timed too
("other_path_us"), which is what says whether SMALL_MAX_PAIRS sits right. Also reported:
the bytes the touched experts occupy over the time (GB/s), and torch's grouped GEMM on the same
routing (as moe_physics_probe.py computes it) where this torch has it.

    python benchmarks/kernels/moe_sweep.py --json moe_sweep.json --configs-out moe_configs.json
    # then: cp moe_configs.json adaspec/layers/moe/moe_configs.json (read by launch_config)
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from adaspec.layers.moe import RouterConfig, route
from adaspec.layers.moe.triton_kernels import SMALL_MAX_PAIRS, fit_small, fused_experts_triton, plan
from bench_attention import graph_us   # (benchmarks/kernels/: one CUDA-graph timer for every sweep)

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2),
          "glm-4.5-air": (128, 4096, 1408, 8)}


def candidates(pairs: int):
    bms = [16] if pairs <= 128 else [16, 32, 64] if pairs <= 2048 else [32, 64, 128]
    for bm, bn, bk, nw, ns in itertools.product(bms, [32, 64, 128], [64, 128], [4, 8], [3, 4]):
        if bm * bn >= 128 * 128 and nw == 4:   # large tiles want 8 warps
            continue
        if bm <= 16 and bn == 128 and nw == 8:
            continue
        yield {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}


def small_candidates(top_k: int):
    """Small-path launches, fitted (fit_small) and deduplicated, the likelier ones first."""
    seen = []
    for ns, nw, bn, bk, dbn, dbk in itertools.product([3, 4, 2], [4, 8], [16, 32], [256, 128], [8, 16], [128, 64]):
        c = fit_small({"BLOCK_N": bn, "BLOCK_K": bk, "DOWN_BLOCK_N": dbn, "DOWN_BLOCK_K": dbk,
                       "num_warps": nw, "num_stages": ns}, top_k, 2)
        if c not in seen:
            seen.append(c)
            yield c


def grouped_mm_moe(x, w13_t, w2_t, weights, ids):
    """The probe's reference: tokens sorted by expert, torch._grouped_mm, weighted sum back."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort()
    counts = torch.zeros(w13_t.shape[0], dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    g, u = torch._grouped_mm(x[order // k], w13_t, offs=offs).chunk(2, -1)
    ys = torch._grouped_mm(F.silu(g) * u, w2_t, offs=offs)
    out = torch.empty_like(ys)
    out[order] = ys
    return (out.view(T, k, -1) * weights.unsqueeze(-1)).sum(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--configs-out", default=None, help="write the best launch per bucket (moe_configs.json format)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,4,8,16,64,256,1024,4096")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop sweeping after this many seconds")
    a = ap.parse_args(argv)
    E, H, I, K = SHAPES[a.shape]
    dt, dev = torch.bfloat16, a.device
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H ** -0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=dt) * I ** -0.5
    expert_bytes = 2 * 3 * H * I
    try:   # torch's grouped GEMM wants [E, K, N] operands
        w13_t, w2_t = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
        grouped_ok = hasattr(torch, "_grouped_mm")
    except Exception:  # noqa: BLE001
        grouped_ok = False
    tokens = [int(t) for t in a.tokens.split(",")]
    t_start = time.perf_counter()
    records, best = [], {"aligned": {}, "small": {}}
    for n_done, T in enumerate(tokens):
        # Each token count gets its share of the budget (and what earlier ones left).
        deadline = t_start + a.budget_s * (n_done + 1) / len(tokens)
        x = torch.randn(T, H, device=dev, dtype=dt)
        weights, ids = route(torch.randn(T, E, device=dev), RouterConfig("softmax", E, K, renormalize=True))
        weights = weights.to(dt)
        pairs = T * K
        touched = int(torch.unique(ids).numel())
        path, default_cfg = plan(T, K, E, H, I, 2)
        ref = fused_experts_triton(x, w13, w2, weights, ids, default_cfg, path=path)
        rec = {"T": T, "pairs": pairs, "path": path, "distinct_experts": touched, "default": default_cfg,
               "default_us": graph_us(lambda: fused_experts_triton(x, w13, w2, weights, ids, default_cfg, path=path)),
               "bytes_touched_MB": touched * expert_bytes / 1e6, "candidates": []}
        if pairs <= 4 * SMALL_MAX_PAIRS:   # the crossover: the other path's default launch
            other, other_cfg = plan(T, K, E, H, I, 2, "aligned" if path == "small" else "small")
            rec["other_path"], rec["other_path_us"] = other, graph_us(
                lambda: fused_experts_triton(x, w13, w2, weights, ids, other_cfg, path=other))
        if grouped_ok:
            try:
                rec["grouped_mm_us"] = graph_us(lambda: grouped_mm_moe(x, w13_t, w2_t, weights, ids))
            except Exception as ex:  # noqa: BLE001 - a reference that does not run is reported, not fatal
                rec["grouped_mm_us"] = f"error: {ex}"[:160]
        for cfg in (small_candidates(K) if path == "small" else candidates(pairs)):
            if time.perf_counter() > deadline:
                rec["truncated"] = True
                break
            try:
                out = fused_experts_triton(x, w13, w2, weights, ids, cfg, path=path)
                err = float((out.float() - ref.float()).abs().max())
                us = graph_us(lambda cfg=cfg: fused_experts_triton(x, w13, w2, weights, ids, cfg, path=path))
            except Exception as ex:  # noqa: BLE001 - e.g. out of shared memory: skip the candidate
                rec["candidates"].append({**cfg, "error": f"{type(ex).__name__}: {ex}"[:120]})
                continue
            rec["candidates"].append({**cfg, "us": us, "max_abs_diff": err})
        ok = [c for c in rec["candidates"] if "us" in c and c["max_abs_diff"] < 5e-2]
        if ok:
            top = min(ok, key=lambda c: c["us"])
            rec["best"] = top
            rec["best_GBps"] = rec["bytes_touched_MB"] * 1e6 / (top["us"] * 1e-6) / 1e9
            best[path][pairs] = {k: v for k, v in top.items() if k not in ("us", "max_abs_diff")}
        records.append(rec)
        print(f"T={T} pairs={pairs} experts={touched} {path}: default {rec['default_us']:.1f} us, best "
              f"{rec.get('best', {}).get('us', float('nan')):.1f} us {rec.get('best')}, "
              f"{rec.get('other_path')} default {rec.get('other_path_us')} us, grouped_mm "
              f"{rec.get('grouped_mm_us')}", flush=True)
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else dev, "shape": a.shape,
                       "E_H_I_K": [E, H, I, K],
                       "records": records}, f, indent=1)
    if a.configs_out and any(best.values()):
        tables = {}
        for path, found in best.items():   # keys as triton_kernels._table reads them
            if found:
                table = {str(p): c for p, c in sorted(found.items())}
                table[str(1 << 62)] = found[max(found)]
                tables[f"E{E}_H{H}_I{I}" + ("_small" if path == "small" else "")] = table
        with open(a.configs_out, "w") as f:
            json.dump(tables, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
