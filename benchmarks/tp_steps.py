"""Tensor parallelism on one host (issues 21 and 22): decode step times at TP=N against TP=1,
both measured in the same call, and against physics_probe's single-GPU T(b, q) of that call.

    python3 .carry/tools/physics_probe.py --batch 1,16,64,256 --q 1,4 --ctx 512 --json physics.json
    # two GPUs (nvidia-h200-x2): TP=1 vs TP=2, chain 3 at TP=2, all-reduce profile
    python3 benchmarks/tp_steps.py --physics physics.json --out tp_steps.json --profile
    # one GPU: TP=1 through today's path and through a one-rank NCCL world (the sharded layers
    # and their collectives, captured in the CUDA graphs, over a world of one)
    python3 benchmarks/tp_steps.py --physics physics.json --out tp1.json --configs tp1,tp1world

Configurations (Llama-3.1-8B shape by default, `--shape` for another; bf16, random weights,
512-token prompts, speculation with a SIMULATED acceptance of 0.8, every cost real):
  tp1        off, one process (the default engine)
  tp1world   off, TP=1 through `ModelRunner(cfg, tp=<NCCL world of one rank>)`
  tpN        off, tensor_parallel_size=N (N = --tp, default 2)
  tpNep      off, TP=N with --enable-expert-parallel (MoE shapes: whole experts per rank)
  tpNchain3  always, chain of 3, at TP=N: `LLM.generate` tok/s at b = 1 against tpN off
Targets (issue 22): tp1/tpN step time >= 1.7 at b = 1 and >= 1.8 at b = 256; chain 3 at TP=2
>= 2.2x TP=2 off at b = 1; tp1world within 2% of tp1. Writes JSON and a PNG next to it.
"""
from __future__ import annotations

import argparse
import gc
import json
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_fast_path import generate_tok_s, make_llm, step_times, write_dirs, write_result  # noqa: E402

from adaspec import LLM  # noqa: E402
from adaspec.bench.shapes import SHAPES  # noqa: E402


def one_rank_world_llm(target: str, max_num_seqs: int) -> tuple[LLM, float]:
    """An LLM whose runner is rank 0 of a one-rank NCCL world (the tensor-parallel layers and
    collectives, no workers): what a TP=1 world costs against the plain path."""
    from adaspec.config import EngineConfig
    from adaspec.engine.engine import Engine
    from adaspec.engine.runner import ModelRunner
    from adaspec.parallel import TPGroup

    t0 = time.perf_counter()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    tp = TPGroup.init(0, 1, torch.device("cuda", 0), init)
    cfg = EngineConfig.create(target, load_format="dummy", device="cuda", dtype="bfloat16", max_num_seqs=max_num_seqs,
                              max_model_len=2048, memory_bytes=40 * 2**30)
    llm = LLM.__new__(LLM)
    llm.engine = Engine(cfg, runner=ModelRunner(cfg, tp=tp))
    llm.world = tp
    torch.cuda.synchronize()
    return llm, time.perf_counter() - t0


def nccl_ms(prof: dict) -> float:
    """Device time per step in NCCL kernels (the all-reduces and the logits' all-gather)."""
    return sum(k["ms_per_step"] for k in prof.get("top_kernels", []) if "nccl" in k["name"].lower())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--physics", required=True)
    ap.add_argument("--physics-key", default="T_ms")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--configs", default=None, help="comma list (default: tp1,tpN,tpNchain3)")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--profile", action="store_true", help="kernel profile at b = 1 and 256 (NCCL time per step)")
    ap.add_argument("--out", default="tp_steps.json")
    a = ap.parse_args(argv)
    n = a.tp
    configs = (a.configs or f"tp1,tp{n},tp{n}chain3").split(",")
    batches = [int(b) for b in a.batches.split(",")]
    phys = json.loads(Path(a.physics).read_text())[a.physics_key]
    target, draft = write_dirs(a.shape)
    res: dict = {"device": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                 "torch": torch.__version__, "shape": a.shape, "tp": n,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "physics_T_ms": phys, "startup_s": {}, "steps": {}, "generate": {}, "targets": {}}
    for config in configs:
        chain = config.endswith("chain3")
        size = 1 if config.startswith("tp1") else n
        if config == "tp1world":
            llm, startup = one_rank_world_llm(target, max(batches))
        else:
            llm, startup = make_llm(target, draft, "chain3" if chain else "off", max_num_seqs=max(batches),
                                    tensor_parallel_size=size, enable_expert_parallel=config.endswith("ep"))
        res["startup_s"][config] = startup
        print(f"[{config}] start-up {startup:.1f} s", flush=True)
        if chain:
            res["generate"][config] = generate_tok_s(llm, 1, repeats=4)
        else:
            for b in batches:
                r = step_times(llm, b, profile=a.profile and b in (1, 256) and size > 1)
                ref = phys.get(f"{b}x1")
                ref = ref if isinstance(ref, (int, float)) else None   # (the probe writes its errors there)
                r["physics_ms"], r["step_ratio"] = ref, (r["step_ms"] / ref if ref else None)
                if "profile" in r:
                    r["nccl_ms_per_step"] = nccl_ms(r["profile"])
                res["steps"][f"{config}:b{b}"] = r
                print(f"[{config}] b={b}: step {r['step_ms']:.3f} ms (x{r['step_ratio'] or 0:.3f} T)", flush=True)
            if size > 1 and f"tp{n}chain3" in configs:
                res["generate"][config] = generate_tok_s(llm, 1, repeats=4)
        llm.close()   # the workers of a TP engine
        if getattr(llm, "world", None) is not None:
            llm.world.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        Path(a.out).write_text(json.dumps(res, indent=1))
    s, t = res["steps"], res["targets"]
    for b in batches:
        one, many, world = s.get(f"tp1:b{b}"), s.get(f"tp{n}:b{b}"), s.get(f"tp1world:b{b}")
        if one and many:
            t[f"speedup_tp{n}_b{b}"] = one["step_ms"] / many["step_ms"]   # targets: >= 1.7 (b=1), 1.8 (b=256)
        ep = s.get(f"tp{n}ep:b{b}")
        if ep and many:
            t[f"ep_over_tp{n}_b{b}"] = ep["step_ms"] / many["step_ms"]   # expert parallel vs experts cut
        if one and world:
            t[f"tp1world_over_tp1_b{b}"] = world["step_ms"] / one["step_ms"]   # target: <= 1.02
        if many and "nccl_ms_per_step" in many:
            t[f"nccl_ms_per_step_b{b}"] = many["nccl_ms_per_step"]
    g = res["generate"]
    if f"tp{n}chain3" in g and f"tp{n}" in g:
        t[f"chain3_over_off_tp{n}_b1"] = g[f"tp{n}chain3"]["tok_s"] / g[f"tp{n}"]["tok_s"]   # target: >= 2.2
    write_result(res, t, a.out, plot)
    return 0


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    by_config: dict = {}
    for key, r in res["steps"].items():
        config, b = key.split(":b")
        by_config.setdefault(config, []).append((int(b), r["step_ms"]))
    for config, pts in by_config.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=config)
    phys = sorted((int(k.split("x")[0]), v) for k, v in res["physics_T_ms"].items()
                  if k.endswith("x1") and isinstance(v, (int, float)))
    ax.plot([p[0] for p in phys], [p[1] for p in phys], "k--", label="physics T(b, 1), one GPU")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (decoding requests)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"{res['shape']} decode steps, TP=1 vs TP={res['tp']}, {res['device'][0]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
