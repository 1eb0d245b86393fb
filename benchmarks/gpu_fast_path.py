"""GPU fast-path benchmark (issue 9): every target as a ratio measured in one run.

    python3 physics_probe.py --batch 1,16,64,256 --q 1,4,16 --ctx 512 --json physics.json
    python3 benchmarks/gpu_fast_path.py --physics physics.json --out result.json [--hf hf_cb.json]
    python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics moe_physics.json \
        --physics-key roofline_ms --batches 1,16,64,256 --skip generate,throughput

`--shape` picks the model shape (adaspec/bench/shapes.py; default the Llama-3.1-8B shape), bf16, random weights (`load_format=dummy`), 512-token prompts;
speculation with a simulated acceptance rate of 0.8 (the cost side is real). Measures:
  1. step time of decode (b = 1, 16, 64, 256) and of verification (chain 3: q = 4, the
     16-token tree: q = 16; b = 1, 16, 64), whole engine step and target forward alone,
     against physics_probe's T(b, q) from the same machine and session;
  2. batch-1 `LLM.generate` tok/s (512 in, 256 out);
  3. offline throughput at b = 256 (512 in, 256 out) against 256 / T(256, 1) and against
     Hugging Face continuous batching (`--hf`, from hf_cb_probe.py in the same run);
  4. `always` chain 3 vs `off` at b = 1;
  5. start-up time (load + profile + graph capture) and graph memory.
Writes JSON and a PNG next to it.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from adaspec import LLM, SamplingParams
from adaspec.bench.shapes import SHAPES, write_shape_dirs

CTX = 512
CONFIGS = {
    "off": dict(),
    "chain3": dict(speculation="always", num_steps=3, topk=1),
    "tree16": dict(speculation="always", num_steps=2, topk=4, num_draft_tokens=16),
    "auto4": dict(speculation="auto", num_steps=4, topk=1),   # diagnostics only (not a target)
    # the draft loaded, every request `speculate=False` (issue 27: what an unused draft costs)
    "idle": dict(speculation="always", num_steps=3, topk=1),
}
Q = {"off": 1, "chain3": 4, "tree16": 16, "auto4": 4, "idle": 1}
OPT_OUT = {"idle"}   # configurations whose requests do not speculate


def write_dirs(shape: str = "llama-8b") -> tuple[str, str]:
    return write_shape_dirs(shape)


def make_llm(target: str, draft: str, config: str, max_num_seqs: int, **kw) -> tuple[LLM, float]:
    t0 = time.perf_counter()
    extra = dict(CONFIGS[config])
    if config != "off":
        extra.update(draft=draft, spec_simulate_accept_rate=0.8)
    # Prefill unpaced (the step budget, as before engine/prefill_pacer.py): the batch is built in
    # a few steps, so every request's context at the timed steps is ~CTX, as physics_probe's
    # T(b, q). Paced, a burst of 64 prompts prefilled over ~150 steps while the first ones
    # decoded, and the timed steps read longer contexts (+4% per decode step at b = 64: the
    # apparent regression of issue 21, located by session 5's call 1).
    kw.setdefault("long_prefill_token_threshold", 8192)
    llm = LLM(target, load_format="dummy", device="cuda", dtype="bfloat16", max_num_seqs=max_num_seqs,
              max_model_len=2048, kv_cache_memory=40 * 2**30, **extra, **kw)
    torch.cuda.synchronize()
    return llm, time.perf_counter() - t0


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128000, (CTX,), generator=g).tolist() for _ in range(n)]


def profile_steps(eng, steps: int = 6, top: int = 20) -> dict:
    """A kernel profile of `steps` engine steps: device busy time (sum of kernel times) per
    step against wall time per step, and the kernels that take the most time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    def dev_us(e):
        return getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)

    busy = sum(dev_us(e) for e in events) / 1e3 / steps          # us -> ms
    by_name: dict[str, list] = {}
    for e in events:
        t = by_name.setdefault(e.name, [0.0, 0])
        t[0] += dev_us(e) / 1e3 / steps
        t[1] += 1
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    # Where the device waits: gaps between consecutive device events, the largest with the
    # kernels on either side (what the stream waited for).
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    gaps = [(b[0] - a[1], a[2][:50], b[2][:50]) for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    big = sorted(gaps, reverse=True)[:8]
    return {"wall_ms_per_step": wall * 1e3, "device_busy_ms_per_step": busy,
            "gaps_ms_per_step": sum(g[0] for g in gaps) / 1e3 / steps,
            "gaps_over_20us_per_step": sum(1 for g in gaps if g[0] > 20) / steps,
            "largest_gaps_us": [[round(g[0], 1), g[1], g[2]] for g in big],
            "device_idle_ms_per_step": wall * 1e3 - busy,
            "kernels_per_step": len(events) / steps,
            "top_kernels": [{"name": n[:90], "ms_per_step": round(v[0], 4), "calls_per_step": v[1] / steps}
                            for n, v in kernels]}


class _HostClock:
    """Wall time the host spends in `runner.launch` and waiting on step-end events in
    `runner.collect` (instance attributes shadow the methods until `stop`)."""

    def __init__(self, runner):
        self.runner, self.launch, self.wait = runner, 0.0, 0.0
        launch, collect = runner.launch, runner.collect

        def timed_launch(plan):
            t = time.perf_counter()
            try:
                return launch(plan)
            finally:
                self.launch += time.perf_counter() - t

        def timed_collect(step):
            t = time.perf_counter()
            if hasattr(step.end, "synchronize"):   # (on CPU the mark is a wall-clock float)
                step.end.synchronize()
            self.wait += time.perf_counter() - t
            return collect(step)

        runner.launch, runner.collect = timed_launch, timed_collect

    def stop(self) -> None:
        del self.runner.launch, self.runner.collect


class _GcClock:
    """Collections of the cyclic garbage collector and the time they took, until `stop`."""

    def __init__(self):
        import gc

        self.ms, self.count, self._t = 0.0, [0, 0, 0], 0.0

        def cb(phase, info):
            if phase == "start":
                self._t = time.perf_counter()
            else:
                self.ms += (time.perf_counter() - self._t) * 1e3
                self.count[info["generation"]] += 1

        self._cb = cb
        gc.callbacks.append(cb)

    def stop(self) -> None:
        import gc

        gc.callbacks.remove(self._cb)


def step_times(llm: LLM, b: int, steps: int = 12, profile: bool = False, warmup: int = 20,
               speculate: bool = True) -> dict:
    """Median wall time of steady-state engine steps with b decoding requests, and the
    target forward alone (its CUDA graph replayed, CUDA events)."""
    eng = llm.engine
    for i, p in enumerate(prompts(b, seed=b)):
        eng.add_request(f"st{b}-{i}", p, SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True,
                                                                speculate=speculate))
    while any(r.num_computed < len(r.prompt_token_ids) for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    # Past the first steps of a new batch: their spans fall for a dozen steps (12.1 to 11.2 ms
    # for chain 3 at b=64 in run 7 of 2026-12-01b) before they settle.
    for _ in range(warmup):
        eng.step()
    ctx = [r.num_computed for r in eng.scheduler.running]   # the contexts the timed steps read
    # Steady state, pipelined as the engine runs. With overlap, each `step()` returns once the
    # previous step's device work is done, so the time between returns is a step's time on
    # the device (with any wait for the host in it). Timing from a synchronized start instead
    # adds, to every step, the host preparation of the first one, which nothing overlaps
    # (`step_ms_from_sync`, kept for comparison: ~host_launch_ms / steps more).
    host, gcc = _HostClock(eng.runner), _GcClock()
    spans, spans_sync = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
        spans.append(eng.runner.last_step_time * 1e3)
    wall = (time.perf_counter() - t0) / steps * 1e3
    host.stop()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(steps):
        eng.step()
        spans_sync.append(eng.runner.last_step_time * 1e3)
    torch.cuda.synchronize()
    gcc.stop()
    out = {"step_ms": wall, "overlap": eng.config.overlap,
           "ctx_mean": sum(ctx) / max(1, len(ctx)), "ctx_max": max(ctx, default=0),
           "step_ms_from_sync": (time.perf_counter() - t1) / steps * 1e3,
           # the engine's own CUDA-event span of each step (what `auto` sees), median
           "event_step_ms": sorted(spans)[len(spans) // 2],
           "event_spans_ms": [[round(x, 3) for x in spans], [round(x, 3) for x in spans_sync]],
           "gc_ms": gcc.ms, "gc_collections": gcc.count,
           # Host time per step spent enqueueing (`launch`) and waiting for the device
           # (inside `collect`): a step whose host time outside the wait is about the step
           # time is host-bound.
           "host_launch_ms": host.launch / steps * 1e3, "host_wait_ms": host.wait / steps * 1e3,
           "host_busy_ms": wall - host.wait / steps * 1e3}
    if profile:
        try:
            out["profile"] = profile_steps(eng)
        except Exception as ex:  # a failed profile must not lose the timings
            out["profile"] = {"error": repr(ex)}
    runner = eng.runner
    # (Graphs replayed alone on rank 0 of a TP engine would wait in their collectives for
    # workers that replay nothing: measured with one process only.)
    if runner.graphs is not None and getattr(runner, "driver", None) is None:
        q = 1 + (eng.last_draft_len if eng.last_draft_len else 0)
        tree = eng.config.spec.topk > 1 and eng.last_draft_len > 0
        g = runner.graphs.lookup([q] * b, tree)
        if g is not None:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            @torch.inference_mode()
            def forward():   # the graph (up to the hidden states) and the LM head on every row
                runner.model.lm_head(g.replay()[0])

            def timed(fn) -> float:
                fn()
                s.record()
                for _ in range(10):
                    fn()
                e.record()
                torch.cuda.synchronize()
                return s.elapsed_time(e) / 10

            out["forward_ms"] = timed(forward)
            out["graph"] = [g.batch, g.q, tree]
            # The other graphs of the step, alone (the step's own inputs, replayed again; the
            # requests are aborted below): what drafting and verify + commit cost the device.
            gs = runner.graphs
            post = [p for k, p in gs.post_graphs.items() if k[:3] == (g.batch, g.q, tree)]
            if post:
                out["post_ms"] = timed(post[0].graph.replay)
            if q > 1:
                dg = ([t for k, t in gs.tree_graphs.items() if k[0] == g.batch and k[2] == q] if tree
                      else [gs.draft_graphs.get((g.batch, q - 1))])
                if dg and dg[0] is not None:
                    out["draft_ms"] = timed(dg[0].graph.replay)
    for rid in list(eng.requests):
        eng.abort_request(rid)
    return out


def generate_tok_s(llm: LLM, b: int, out_len: int = 256, repeats: int = 1, speculate: bool = True) -> dict:
    """`LLM.generate` of b prompts, `repeats` times in a row (different prompts): output tokens
    over wall time. With simulated acceptance one 256-token request's steps vary by several
    percent with the draws (86 to 94 steps for chain 3 in this session's runs): b = 1 is
    measured over several requests."""
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, speculate=speculate)
    llm.generate(prompts(1, seed=99), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                     speculate=speculate))
    torch.cuda.synchronize()
    eng = llm.engine
    step, times = eng.step, []

    def timed_step():   # where the time goes: the first steps (prefill), steady steps, the slowest
        t = time.perf_counter()
        try:
            return step()
        finally:
            times.append(time.perf_counter() - t)

    eng.step = timed_step
    n, dt, per_run = 0, 0.0, []
    try:
        for r in range(repeats):
            t0 = time.perf_counter()
            outs = llm.generate(prompts(b, seed=7 + r), sp)
            torch.cuda.synchronize()
            t = time.perf_counter() - t0
            k = sum(len(o.token_ids) for o in outs)
            per_run.append(round(k / t, 1))
            n, dt = n + k, dt + t
    finally:
        del eng.step
    st = llm.stats()
    ms = sorted(t * 1e3 for t in times)
    return {"batch": b, "repeats": repeats, "output_tokens": n, "seconds": dt, "tok_s": n / dt, "tok_s_per_run": per_run,
            "accept_length": st["accept_length"],
            "engine_steps": len(times), "in_steps_s": sum(times), "median_step_ms": ms[len(ms) // 2] if ms else None,
            "first_steps_ms": [round(t * 1e3, 2) for t in times[:4]], "slowest_steps_ms": [round(t, 2) for t in ms[-6:]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--physics", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b", help="model shape (default %(default)s)")
    ap.add_argument("--physics-key", default="T_ms",
                    help="the probe's table to compare with: T_ms (default), or roofline_ms of moe_physics_probe.py")
    ap.add_argument("--batches", default=None,
                    help="comma list of batch sizes for every configuration (default: the plan's own)")
    ap.add_argument("--hf", default=None)
    ap.add_argument("--out", default="gpu_fast_path.json")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: steps,generate,throughput")
    ap.add_argument("--profile", action="store_true", help="kernel profile of the steps at --profile-batches")
    ap.add_argument("--profile-batches", default="1,16,64", help="batches --profile profiles (default %(default)s)")
    ap.add_argument("--configs", default="off,chain3,tree16", help="comma list of configurations to run")
    ap.add_argument("--prefill-threshold", type=int, default=8192,
                    help="long_prefill_token_threshold of the engines (default: the step budget, unpaced; 0: paced)")
    ap.add_argument("--no-overlap", dest="overlap", action="store_false",
                    help="run the engine without overlap (for comparison)")
    a = ap.parse_args(argv)
    skip = set(filter(None, a.skip.split(",")))
    phys = json.loads(Path(a.physics).read_text())[a.physics_key]
    target, draft = write_dirs(a.shape)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ctx": CTX,
                 "shape": a.shape, "physics_key": a.physics_key,
                 "physics_T_ms": phys, "startup": {}, "steps": {}, "targets": {}}

    prof_batches = {int(b) for b in a.profile_batches.split(",")}

    def T(b, q):
        v = phys.get(f"{b}x{q}")
        return v if isinstance(v, (int, float)) else None

    plan = (("off", (1, 16, 64, 256)), ("chain3", (1, 16, 64)), ("tree16", (1, 16, 64)), ("auto4", (1, 16)),
            ("idle", (1, 64, 256)))
    if a.batches:
        plan = tuple((c, tuple(int(b) for b in a.batches.split(","))) for c, _ in plan)
    for config, batches in [c for c in plan if c[0] in a.configs.split(",")]:
        llm, startup = make_llm(target, draft, config, max_num_seqs=max(batches), overlap=a.overlap,
                               long_prefill_token_threshold=a.prefill_threshold)
        g = llm.engine.runner.graphs
        res["startup"][config] = {"seconds": startup, "graphs": len(g.graphs) if g else 0,
                                  "capture_seconds": g.capture_seconds if g else 0,
                                  "graph_memory_GiB": g.memory_bytes / 2**30 if g else 0}
        print(f"[{config}] start-up {startup:.1f} s, {res['startup'][config]}", flush=True)
        if "steps" not in skip:
            q = Q[config]
            for b in batches:
                r = step_times(llm, b, profile=a.profile and b in prof_batches, speculate=config not in OPT_OUT)
                ref = T(b, q)
                r.update(physics_ms=ref, step_ratio=r["step_ms"] / ref if ref else None,
                         forward_ratio=r.get("forward_ms", 0) / ref if ref and "forward_ms" in r else None)
                res["steps"][f"{config}:b{b}"] = r
                print(f"[{config}] b={b} q={q}: {r}", flush=True)
        if config == "off" and "generate" not in skip:
            res["generate_b1_off"] = generate_tok_s(llm, 1, repeats=4)
            print("generate b=1 off:", res["generate_b1_off"], flush=True)
        if config == "off" and "throughput" not in skip:
            res["throughput_b256_off"] = generate_tok_s(llm, 256)
            print("throughput b=256 off:", res["throughput_b256_off"], flush=True)
        if config == "idle" and "generate" not in skip:   # 512 in, 256 out, prefill included
            res["generate_b1_idle"] = generate_tok_s(llm, 1, repeats=4, speculate=False)
            print("generate b=1 idle:", res["generate_b1_idle"], flush=True)
        if config == "chain3" and "generate" not in skip:
            res["generate_b1_chain3"] = generate_tok_s(llm, 1, repeats=4)
            print("generate b=1 chain3:", res["generate_b1_chain3"], flush=True)
        del llm, g
        gc.collect()   # the engine holds reference cycles: free its KV cache before the next one
        torch.cuda.empty_cache()
        Path(a.out).write_text(json.dumps(res, indent=1))

    t = res["targets"]
    if "generate_b1_off" in res:
        t["2_b1_tok_s"] = res["generate_b1_off"]["tok_s"]
    if "throughput_b256_off" in res and T(256, 1):
        t["3_b256_vs_physics"] = res["throughput_b256_off"]["tok_s"] / (256 / (T(256, 1) / 1e3))
        if a.hf and Path(a.hf).exists():
            hf = json.loads(Path(a.hf).read_text()).get("paged|sdpa:256")
            if isinstance(hf, (int, float)):
                t["3_b256_vs_hf_cb"] = res["throughput_b256_off"]["tok_s"] / hf
                res["hf_cb_256_tok_s"] = hf
    if "generate_b1_chain3" in res and "generate_b1_off" in res:
        t["4_chain3_vs_off_b1"] = res["generate_b1_chain3"]["tok_s"] / res["generate_b1_off"]["tok_s"]
    if "generate_b1_idle" in res and "generate_b1_off" in res:   # issue 27: >= 0.995
        t["6_idle_vs_off_b1"] = res["generate_b1_idle"]["tok_s"] / res["generate_b1_off"]["tok_s"]
    t["5_startup_max_s"] = max(v["seconds"] for v in res["startup"].values())
    t["5_graph_memory_max_GiB"] = max(v["graph_memory_GiB"] for v in res["startup"].values())
    t["1_ratios"] = {k: (round(v["step_ratio"], 3) if v.get("step_ratio") else None,
                         round(v["forward_ratio"], 3) if v.get("forward_ratio") else None)
                     for k, v in res["steps"].items()}
    write_result(res, t, a.out, plot)
    return 0


def write_result(res: dict, targets: dict, out: str, plot_fn) -> None:
    """Write the JSON, print the targets, then draw the PNG next to the JSON (a failed plot
    must not lose the JSON)."""
    Path(out).write_text(json.dumps(res, indent=1))
    print(json.dumps(targets, indent=1))
    try:
        plot_fn(res, Path(out).with_suffix(".png"))
    except Exception as ex:
        print("plot failed:", ex)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(res["steps"])
    step = [res["steps"][k]["step_ratio"] or 0 for k in keys]
    fwd = [res["steps"][k].get("forward_ratio") or 0 for k in keys]
    fig, ax = plt.subplots(figsize=(10, 4))
    x = range(len(keys))
    ax.bar([i - 0.2 for i in x], step, 0.4, label="engine step / T(b,q)")
    ax.bar([i + 0.2 for i in x], fwd, 0.4, label="target forward (graph) / T(b,q)")
    ax.axhline(1.15, color="red", ls="--", label="target 1.15x")
    ax.set_xticks(list(x), keys, rotation=30)
    ax.set_ylabel("ratio to physics probe")
    ax.set_title(f"adaspec step time vs physics ({res.get('physics_key', 'T_ms')}), {res['device']}, "
                 f"{res.get('shape', 'llama-8b')} shape, ctx {res['ctx']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
