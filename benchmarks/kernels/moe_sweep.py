"""Launch-parameter sweep of the fused-MoE Triton kernel (adaspec/layers/moe/triton_kernels.py)
per batch bucket, on a GPU, at the Qwen3-30B-A3B expert shape by default (E 128, H 2048, I 768,
top-8, bf16; random router logits, so the experts a batch touches are near the uniform case).

For each token count T (decode b = 1, 8, 16, 64, 256 at q = 1 and 4, and a prefill chunk) it
searches the launch of the path the dispatch takes there (`use_small_path`):
- small: every candidate (gate/up BLOCK_N, BLOCK_K, DOWN_BLOCK_N, DOWN_BLOCK_K, num_warps,
  num_stages) timed as the whole two-launch computation;
- aligned: stage by stage, so the record is also the kernel profile of the path. For each
  BLOCK_M: both alignments (one program, chunked: the crossover behind
  align.ONE_PROGRAM_MAX_PAIRS), gate/up's best (BLOCK_N, BLOCK_K, warps, stages) timed alone,
  down's best timed alone (its own DOWN_* launch), each best tile again with its N tiles first
  (N_FIRST / DOWN_N_FIRST, kept where faster), and the top-k reduction; the BLOCK_M of the
  least total wins, and the merged launch is timed as one call and checked against the default.
Times are 20 calls replayed from one CUDA graph, best of 5 replays. Near the small path's limit
(pairs <= 4 x SMALL_MAX_PAIRS) the other path's default launch is timed too ("other_path_us"),
which is what says whether SMALL_MAX_PAIRS sits right. Also reported: the bytes the touched
experts occupy over the time (GB/s), and torch's grouped GEMM on the same routing (as
moe_physics_probe.py computes it) where this torch has it. A --budget-s deadline (shared out
over the token counts) cuts a search short, keeping the best found so far.

    python benchmarks/kernels/moe_sweep.py --json moe_sweep.json --configs-out moe_configs.json
    # then: cp moe_configs.json adaspec/layers/moe/moe_configs.json (read by launch_config)
    # one bucket again (b = 256 verification: 1,024 tokens), the others kept:
    python benchmarks/kernels/moe_sweep.py --tokens 1024 --json s.json --configs-out moe_configs.json \
        --update adaspec/layers/moe/moe_configs.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from adaspec.layers.moe import RouterConfig, route
from adaspec.layers.moe.align import align
from adaspec.layers.moe.triton_kernels import (OPEN_BUCKET, SMALL_MAX_PAIRS, down_aligned, fit_shared_memory,
                                               fit_small, fused_experts_triton, gate_up_aligned, plan, table_key)
from bench_attention import graph_us   # (benchmarks/kernels/: one CUDA-graph timer for every sweep)

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2),
          "glm-4.5-air": (128, 4096, 1408, 8),
          "qwen3-30b-a3b-tp2": (128, 2048, 384, 8)}   # one rank's experts at --tensor-parallel-size 2


def block_ms(pairs: int, E: int) -> list[int]:
    """BLOCK_M candidates, the one nearest the mean rows per expert first (a partial block is padding)."""
    bms = [16] if pairs <= 128 else [16, 32, 64] if pairs <= 2048 else [32, 64, 128]
    return sorted(bms, key=lambda bm: abs(bm - pairs / E))


def tiles(bm: int, dual: bool):
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of one aligned GEMM at BLOCK_M = bm, likelier first;
    `dual`: gate/up's kernel, which holds two fp32 accumulators (large tiles want 8 warps)."""
    bns = {16: [32, 64, 128], 32: [64, 128], 64: [64, 128, 256], 128: [64, 128]}[bm]
    for ns, bk, bn, nw in itertools.product([3, 4], [64, 128], bns, [4, 8]):
        if dual and bm * bn >= 128 * 128 and nw == 4:
            continue
        if bm <= 16 and bn >= 128 and nw == 8:
            continue
        yield bn, bk, nw, ns


def down_keys(c: dict) -> dict:
    """A tile found for the down GEMM as the launch-table keys `triton_kernels.down_launch` reads
    (its own order included, whatever gate/up's is)."""
    return {"DOWN_BLOCK_N": c["BLOCK_N"], "DOWN_BLOCK_K": c["BLOCK_K"], "down_num_warps": c["num_warps"],
            "down_num_stages": c["num_stages"], "DOWN_N_FIRST": c.get("N_FIRST", 0)}


def aligned_search(x, w13, w2, weights, ids, deadline) -> dict:
    """The aligned path's best launch at this routing, stage by stage: for each BLOCK_M, both
    alignments, gate/up's best tile and down's best tile (each GEMM timed alone), and the top-k
    reduction; the BLOCK_M of the least total wins. Returns the stage times and the config."""
    E, H, I = w13.shape[0], x.shape[1], w13.shape[1] // 2
    T, K = ids.shape
    N = T * K
    inter = torch.empty(N, I, dtype=x.dtype, device=x.device)
    flat_w = weights.reshape(-1).contiguous()
    per_bm = []
    for bm in block_ms(N, E):
        if time.perf_counter() > deadline and per_bm:
            break
        al = align(ids, E, bm)
        st = {"BLOCK_M": bm, "align_one_us": graph_us(lambda: align(ids, E, bm, chunked=False)),
              "align_chunked_us": graph_us(lambda: align(ids, E, bm, chunked=True))}
        for stage, dual in (("gate_up", True), ("down", False)):
            def timed(c, dual=dual):
                """us of one GEMM at tile `c`, or None where the launch fails (shared memory, registers)."""
                if dual:
                    fn = lambda: gate_up_aligned(x, w13, inter, al, K, c)  # noqa: E731
                else:
                    fn = lambda: down_aligned(inter, w2, flat_w, al,  # noqa: E731
                                              {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 64, **down_keys(c)}, False)
                try:
                    fn()
                    return graph_us(fn)
                except Exception:  # noqa: BLE001 - e.g. out of shared memory or registers: skip it
                    return None
            found = []
            for bn, bk, nw, ns in tiles(bm, dual):
                if time.perf_counter() > deadline and found:
                    st["truncated"] = True
                    break
                c = fit_shared_memory({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw,
                                       "num_stages": ns}, 2)
                us = timed(c)
                if us is not None:
                    found.append((us, c))
            if not found:
                break
            us, c = min(found, key=lambda f: f[0])
            # the best tile again with its N tiles first (triton_kernels._grid): the order is kept
            # where it measures faster
            us_n = timed({**c, "N_FIRST": 1})
            st[f"{stage}_blocks_first_us"], st[f"{stage}_n_first_us"] = us, us_n
            if us_n is not None and us_n < us:
                us, c = us_n, {**c, "N_FIRST": 1}
            st[f"{stage}_us"], st[f"{stage}_cfg"], st[f"{stage}_tried"] = us, c, len(found)
            if dual:   # down reads what the best gate/up wrote
                gate_up_aligned(x, w13, inter, al, K, c)
        if "down_us" not in st:
            continue
        out_k = down_aligned(inter, w2, flat_w, al, {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 64}, False)
        st["reduce_us"] = graph_us(lambda: out_k.view(T, K, H).sum(dim=1)) if K > 1 else 0.0
        st["total_us"] = (min(st["align_one_us"], st["align_chunked_us"]) + st["gate_up_us"] + st["down_us"]
                          + st["reduce_us"])
        per_bm.append(st)
    top = min(per_bm, key=lambda st: st["total_us"])
    g, d = top["gate_up_cfg"], top["down_cfg"]
    return {"per_block_m": per_bm, "config": {**g, **down_keys(d)}}


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
    ap.add_argument("--update", default=None, metavar="TABLE",
                    help="with --configs-out: TABLE (a moe_configs.json) with only the swept buckets replaced")
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
        if path == "aligned":
            rec["stages"] = aligned_search(x, w13, w2, weights, ids, deadline)
            cfg = rec["stages"]["config"]
            out = fused_experts_triton(x, w13, w2, weights, ids, cfg, path=path)
            rec["best"] = {**cfg, "us": graph_us(lambda: fused_experts_triton(x, w13, w2, weights, ids, cfg, path=path)),
                           "max_abs_diff": float((out.float() - ref.float()).abs().max())}
            if rec["best"]["max_abs_diff"] >= 5e-2:
                rec["rejected"] = rec.pop("best")
        else:
            for cfg in small_candidates(K):
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
                rec["best"] = min(ok, key=lambda c: c["us"])
        if "best" in rec:
            top = rec["best"]
            rec["best_GBps"] = rec["bytes_touched_MB"] * 1e6 / (top["us"] * 1e-6) / 1e9
            best[path][pairs] = {k: v for k, v in top.items() if k not in ("us", "max_abs_diff")}
        records.append(rec)
        for st in rec.get("stages", {}).get("per_block_m", []):
            print(f"  BM={st['BLOCK_M']}: align one {st['align_one_us']:.1f} / chunked {st['align_chunked_us']:.1f}, "
                  f"gate_up {st.get('gate_up_us', float('nan')):.1f}, down {st.get('down_us', float('nan')):.1f}, "
                  f"reduce {st.get('reduce_us', float('nan')):.1f}, total {st.get('total_us', float('nan')):.1f} us",
                  flush=True)
        print(f"T={T} pairs={pairs} experts={touched} {path}: default {rec['default_us']:.1f} us, best "
              f"{rec.get('best', {}).get('us', float('nan')):.1f} us {rec.get('best')}, "
              f"{rec.get('other_path')} default {rec.get('other_path_us')} us, grouped_mm "
              f"{rec.get('grouped_mm_us')}", flush=True)
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else dev, "shape": a.shape,
                       "E_H_I_K": [E, H, I, K],
                       "records": records}, f, indent=1)
    if a.configs_out and any(best.values()):
        base = {}
        if a.update:
            with open(a.update) as f:
                base = json.load(f)
        with open(a.configs_out, "w") as f:
            json.dump(launch_tables(best, E, H, I, base), f, indent=1)
    return 0


def launch_tables(best: dict, E: int, H: int, I: int, base: dict | None = None) -> dict:
    """The moe_configs.json tables (keys as triton_kernels._table reads them) of the launches
    found, {path: {pairs: config}}, each under its bucket (the pairs swept). With `base` (a
    table file's contents): that file with only the swept buckets replaced, so a sweep of some
    token counts keeps the other buckets' measured launches. The open-ended bucket (OPEN_BUCKET)
    takes the largest finite bucket's launch."""
    tables = {k: dict(v) for k, v in (base or {}).items()}
    for path, found in best.items():
        if not found:
            continue
        key = table_key(E, H, I, small=path == "small")
        table = {int(b): c for b, c in tables.get(key, {}).items()}
        table.update(found)
        table.pop(OPEN_BUCKET, None)
        table[OPEN_BUCKET] = table[max(table)]
        tables[key] = {str(b): c for b, c in sorted(table.items())}
    return tables


if __name__ == "__main__":
    raise SystemExit(main())
