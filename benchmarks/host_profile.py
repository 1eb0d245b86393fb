"""Where the host's time goes in a steady-state engine step (issue 19: host/device split).

    python3 benchmarks/host_profile.py --model demo --configs off,chain3 --out host_demo.json
    python3 benchmarks/host_profile.py --shape llama-8b --configs off,chain3 --out host_8b.json

For each configuration: b decoding requests (default 1) are brought to steady state, then N
engine steps are timed (wall time between step returns, the engine's CUDA-event span of each
step, host time inside `runner.launch` and waiting in `runner.collect`), and N more are run
under cProfile (`--kernels`: and 30 under torch.profiler, for the device's busy time). Writes
JSON with the split and the top functions by own time and by cumulative time, and prints the
split. `--shape` runs random weights with simulated
acceptance 0.8; `--model demo` the bundled demo pair (real weights, real acceptance).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from adaspec import LLM, SamplingParams
from gpu_fast_path import _HostClock, profile_steps   # (benchmarks/: the fast-path steps' host clock and kernel profile)
from launch_anatomy import config_kwargs

# Besides launch_anatomy's off / chainK / autoK (auto up to K drafts, 4 without K):
CONFIGS = {"auto8-noprofile": dict(speculation="auto", num_steps=8, auto_profile=False),   # (the start-up profile's A/B)
           "tree": dict(speculation="always", num_steps=6, topk=4, num_draft_tokens=16)}


def build(args, config: str) -> LLM:
    kw = dict(CONFIGS[config]) if config in CONFIGS else config_kwargs(config)
    if args.model == "demo":
        from adaspec.demo import DEMO_HEAD, DEMO_TARGET
        target, draft, extra = str(DEMO_TARGET), str(DEMO_HEAD), {}
    else:
        from adaspec.bench.shapes import write_shape_dirs
        target, draft = write_shape_dirs(args.shape)
        extra = dict(load_format="dummy", dtype="bfloat16", spec_simulate_accept_rate=0.8 if kw else None)
    if kw:
        extra["draft"] = draft
    kw.setdefault("topk", 1)
    return LLM(target, device="cuda" if torch.cuda.is_available() else "cpu", max_num_seqs=max(8, args.batch),
               kv_cache_memory=8 * 2**30, **kw, **extra)


def measure(llm: LLM, args) -> dict:
    eng = llm.engine
    vocab = eng.vocab_size
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        p = torch.randint(3, min(vocab, 5000), (args.prompt_len,), generator=g).tolist()
        eng.add_request(f"hp{i}", p, SamplingParams(max_tokens=eng.max_model_len - args.prompt_len, temperature=0.0, ignore_eos=True))
    for _ in range(args.warmup):
        eng.step()
    runner = eng.runner
    clock = _HostClock(runner)
    spans, walls = [], []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
        spans.append(runner.last_step_time * 1e3)
        walls.append(time.perf_counter())
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    gaps = sorted(1e3 * (b - a) for a, b in zip([t0] + walls, walls))
    clock.stop()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        eng.step()
    pr.disable()
    tables = {}
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(args.top)
        tables[key] = s.getvalue()
    st = llm.stats()
    n = args.steps
    kernels = profile_steps(eng, steps=30) if args.kernels and torch.cuda.is_available() else None
    return {"kernels": kernels, "step_ms": wall, "step_ms_p10_p50_p90": [gaps[len(gaps) * q // 10] for q in (1, 5, 9)], "event_step_ms": sorted(spans)[len(spans) // 2],
            "host_launch_ms": clock.launch / n * 1e3, "host_wait_ms": clock.wait / n * 1e3,
            "host_busy_ms": wall - clock.wait / n * 1e3, "accept_length": st.get("accept_length"),
            "tokens_per_step": st["generation_tokens"] / max(1, st["num_steps"]), "profile": tables}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="'demo' for the bundled pair (else --shape)")
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--configs", default="off,chain3")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)  # (tiny shapes: lower it)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--kernels", action="store_true", help="also a kernel profile of 30 steps (CUDA): device "
                    "busy time and kernels per step, against wall time")
    ap.add_argument("--out", default="host_profile.json")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "configs": {}}
    for i, c in enumerate(args.configs.split(",")):   # (a config named twice is measured twice)
        llm = build(args, c)
        r = measure(llm, args)
        res["configs"][c if c not in res["configs"] else f"{c}#{i}"] = r
        print(f"{c}: step {r['step_ms']:.3f} ms (p10/50/90 {'/'.join(f'{x:.3f}' for x in r['step_ms_p10_p50_p90'])}; "
              f"event {r['event_step_ms']:.3f}), host busy {r['host_busy_ms']:.3f}, "
              f"launch {r['host_launch_ms']:.3f}, wait {r['host_wait_ms']:.3f}, tokens/step {r['tokens_per_step']:.2f}",
              flush=True)
        if r["kernels"]:
            k = r["kernels"]
            print(f"{c}: device busy {k['device_busy_ms_per_step']:.3f} ms/step, {k['kernels_per_step']:.0f} kernels/step "
                  f"(profiled wall {k['wall_ms_per_step']:.3f})", flush=True)
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for c, r in res["configs"].items():
        print(f"==== {c} by own time\n{r['profile']['tottime'][:6000]}")


if __name__ == "__main__":
    main()
