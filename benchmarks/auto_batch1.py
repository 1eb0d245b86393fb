"""`auto` against `always` chain 3 at batch 1 (issue 10, target 2 at concurrency 1), offline.

    python3 benchmarks/auto_batch1.py --out auto_b1.json

Llama-3.1-8B shape, bf16, random weights, simulated acceptance 0.8 (the cost side is real):
one warm-up request, then 8 requests of 512 in / 256 out one after another (the load
experiment's concurrency-1 level without the server), for `auto` (chains 0..4) and for
`always` chain 3, in one process. Prints auto / chain3 and writes JSON with each policy's
draft-length histogram, its cost table, and a trace of (depth, step ms, batch, probe) for
the last 40 steps, which is how the depth flapping at batch 1 was found.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from adaspec import LLM, SamplingParams
from adaspec.bench.shapes import write_shape_dirs

CONFIGS = {"auto": dict(speculation="auto", num_steps=4), "chain3": dict(speculation="always", num_steps=3)}


def run(target: str, draft: str, kw: dict, prompts, sp) -> dict:
    t0 = time.perf_counter()
    llm = LLM(target, draft=draft, load_format="dummy", device="cuda", dtype="bfloat16", topk=1,
              spec_simulate_accept_rate=0.8, max_num_seqs=8, kv_cache_memory=8 * 2**30, **kw)
    startup = time.perf_counter() - t0
    pol = llm.engine.policy
    trace = []
    observe = pol.observe

    def traced(fb):   # what the policy saw: (depth, step ms, batch size, was it a probe)
        trace.append((len(fb.drafted_per_position), round(fb.step_time * 1e3, 3), fb.batch_size,
                      len(fb.drafted_per_position) in getattr(pol, "probes", ())))
        return observe(fb)

    pol.observe = traced
    llm.generate(prompts[:1], sp)                      # warm-up request
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for p in prompts[1:]:
        llm.generate([p], sp)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t1
    st = llm.stats()
    by_depth = {}
    for d, ms, b, _ in trace:
        if b == 1:
            by_depth.setdefault(d, []).append(ms)
    out = {"tok_s": (len(prompts) - 1) * sp.max_tokens / dt, "startup_s": startup,
           "draft_len_histogram": st["draft_len_histogram"], "accept_length": st["accept_length"],
           "policy_state": st["policy_state"], "trace_tail": trace[-40:],
           "probe_steps": [t for t in trace if t[3]][:20],
           "median_step_ms_by_depth": {d: sorted(v)[len(v) // 2] for d, v in sorted(by_depth.items())}}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="auto_b1.json")
    a = ap.parse_args(argv)
    target, draft = write_shape_dirs("llama-8b")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (512,), generator=g).tolist() for _ in range(9)]
    sp = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, kw in CONFIGS.items():
        res[name] = run(target, draft, kw, prompts, sp)
        print(name, json.dumps({k: v for k, v in res[name].items() if k not in ("policy_state", "trace_tail")}),
              flush=True)
    res["auto_over_chain3"] = res["auto"]["tok_s"] / res["chain3"]["tok_s"]
    print("auto / chain3 at b=1:", res["auto_over_chain3"], flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
