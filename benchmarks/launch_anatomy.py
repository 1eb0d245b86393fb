"""Where a host-bound step's launch time goes, part by part (issue 19: the demo pair at batch 1).

    python3 benchmarks/launch_anatomy.py --configs off,chain4 --out anatomy.json

For each configuration one request of the bundled demo pair is brought to steady state, then
N engine steps run with wall-clock timers around the parts of a step (inclusive times: a part
that calls another counts it too), then 30 steps under torch.profiler for the CUDA runtime
calls the host makes (cudaGraphLaunch, kernel launches, copies, events: how long each call
blocks the host), then the step's target graph is replayed on its own, back to back and after
a device synchronize, which tells a slow launch from a launch that waits for the device.
Prints ms per step per part and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict

import torch

from adaspec import LLM, SamplingParams

def config_kwargs(name: str) -> dict:
    """`off`, `chainK` (always, K drafts) or `auto` / `autoK` (auto up to K drafts, 4 by default)."""
    if name == "off":
        return {}
    m = re.fullmatch(r"(chain|auto)(\d*)", name)
    if m is None or (m.group(1) == "chain" and not m.group(2)):
        raise SystemExit(f"unknown configuration {name!r}: off, chainK, auto or autoK")
    return dict(speculation="always" if m.group(1) == "chain" else "auto", num_steps=int(m.group(2) or 4))


class Timers:
    """Wall-clock timers wrapped around named callables (restored by `stop`)."""

    def __init__(self):
        self.t, self.n, self._undo = defaultdict(float), defaultdict(int), []

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None:   # (an older tree without this part: its A/B side)
            return
        is_cls = isinstance(owner, type)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] += time.perf_counter() - t
                self.n[name] += 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn, is_cls))

    def stop(self) -> None:
        for owner, attr, fn, is_cls in reversed(self._undo):
            if is_cls:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr) if attr in vars(owner) else setattr(owner, attr, fn)
        self._undo.clear()


def build(config: str) -> LLM:
    from adaspec.demo import DEMO_HEAD, DEMO_TARGET
    kw = config_kwargs(config)
    if kw:
        kw["draft"] = str(DEMO_HEAD)
    return LLM(str(DEMO_TARGET), device="cuda" if torch.cuda.is_available() else "cpu", max_num_seqs=8, kv_cache_memory=4 * 2**30, **kw)


def runtime_calls(eng, steps: int) -> dict:
    """Host microseconds per step in each CUDA runtime / driver call (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudnn"):
            out[e.key] = {"us_per_step": round(e.cpu_time_total / steps, 2), "calls_per_step": e.count / steps,
                          "max_us": round(getattr(e, "cpu_time_max", 0.0) or 0.0, 1)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us_per_step"]))


def raw_replay(graph, n: int = 200) -> dict:
    """Host microseconds per replay of one captured graph: back to back, and each after a
    device synchronize (a launch that waits for the device shows only in the first)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        graph.replay()
    back = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    synced = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        synced.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    synced.sort()
    return {"back_to_back_us": round(back, 1), "after_sync_median_us": round(synced[n // 2] * 1e6, 1),
            "after_sync_max_us": round(synced[-1] * 1e6, 1)}


def measure(config: str, args) -> dict:
    from adaspec.device.shift import Shift
    from adaspec.engine import cuda_graph as cg
    llm = build(config)
    eng = llm.engine
    runner = eng.runner
    g = torch.Generator().manual_seed(0)
    p = torch.randint(3, min(eng.vocab_size, 5000), (args.prompt_len,), generator=g).tolist()
    eng.add_request("a0", p, SamplingParams(max_tokens=eng.max_model_len - args.prompt_len, temperature=0.0,
                                            ignore_eos=True))
    for _ in range(args.warmup):
        eng.step()
    tm = Timers()
    last = {}

    def keep(name, fn):
        def f(self, *a, **k):
            last[name] = self
            return fn(self, *a, **k)
        return f

    cg._Graph.replay = keep("target", cg._Graph.replay)
    cg._PostGraph.replay = keep("post", cg._PostGraph.replay)
    # (the draft graph's entry point: `replay` since its inputs are derived inside it, `run` before)
    draft_entry = "replay" if "replay" in vars(cg._DraftGraph) else "run"
    setattr(cg._DraftGraph, draft_entry, keep("draft", getattr(cg._DraftGraph, draft_entry)))
    for owner, attr, name in [
            (eng, "step", "engine.step"), (eng.scheduler, "schedule", "scheduler.schedule"),
            (eng.scheduler, "postprocess", "scheduler.postprocess"), (eng, "_observe", "engine._observe"),
            (eng, "_outputs", "engine._outputs"), (runner, "launch", "runner.launch"),
            (runner, "collect", "runner.collect"), (runner, "_prepare", "runner._prepare"),
            (runner, "forward_half", "runner.forward_half"), (runner, "post_half", "runner.post_half"),
            (runner.rows, "apply_updates", "rows.apply_updates"), (Shift, "apply", "Shift.apply"),
            (cg._Graph, "replay", "graph.target"), (cg._PostGraph, "replay", "graph.post"),
            (cg._DraftGraph, draft_entry, "graph.draft"), (torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay"),
            (getattr(runner, "marks", None), "mark", "runner.marks.mark"),
            (runner, "_timer_mark", "runner._timer_mark")]:
        tm.wrap(owner, attr, name)
    if runner.chain is not None:
        tm.wrap(runner.chain, "run", "chain.run")
        tm.wrap(runner.chain, "stage", "chain.stage")
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    tm.stop()
    parts = {k: {"ms_per_step": round(v / args.steps * 1e3, 4), "calls_per_step": tm.n[k] / args.steps}
             for k, v in sorted(tm.t.items(), key=lambda kv: -kv[1])}
    cuda = torch.cuda.is_available()
    rt = runtime_calls(eng, 30) if cuda else {}
    raw = {k: raw_replay(v.graph) for k, v in last.items() if hasattr(v, "graph")} if cuda else {}
    st = llm.stats()
    res = {"pdl": getattr(runner, "pdl", None), "step_ms": round(wall, 4), "parts": parts, "runtime_calls": rt, "raw_replay": raw,
           "tokens_per_step": st["generation_tokens"] / max(1, st["num_steps"]), "launches": st["launches"]}
    del llm
    if cuda:
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="off,chain4")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--out", default="launch_anatomy.json")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "args": vars(args), "configs": {}}
    for c in args.configs.split(","):
        r = res["configs"][c] = measure(c, args)
        print(f"== {c}: step {r['step_ms']:.3f} ms (pdl {r['pdl']}), {r['tokens_per_step']:.2f} tokens/step", flush=True)
        for k, v in r["parts"].items():
            print(f"   {k:24s} {v['ms_per_step']:8.4f} ms/step  ({v['calls_per_step']:.2f} calls)")
        print("   runtime calls (host us/step):", {k: v["us_per_step"] for k, v in list(r["runtime_calls"].items())[:12]})
        print("   raw replay:", r["raw_replay"], flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
