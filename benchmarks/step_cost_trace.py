"""What a step of each draft length costs the engine's cadence at batch 1, and what switching
length costs: the figures `auto` prices lengths by (StepFeedback.step_time), recorded under a
scripted schedule of runs of random lengths (issue 19: the demo pair served at concurrency 1).

    python3 benchmarks/step_cost_trace.py --num-steps 8 --out trace.json

The bundled demo pair runs the held-out prompts one at a time (max_num_seqs 1, overlap on, CUDA
graphs). The policy's `decide` is replaced by a schedule: runs of a length drawn from 0..K, each
run 1, 2, 3, 5, 10 or 30 steps long (seeded). Every step's length, its place in its run, the
length before the run and the figure the engine fed the policy are written; the summary prints,
per length, the median cost of steps 1, 2, 3 and 4+ of a run, over the median of the steady
steps (4+) of length 0. Steps with prompt rows are left out of the summary.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from adaspec import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-steps", type=int, default=8)
    ap.add_argument("--dataset", default="tests/data/demo_heldout.jsonl")
    ap.add_argument("--num-prompts", type=int, default=48, help="requests, cycling through the dataset's prompts")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="step_cost_trace.json")
    a = ap.parse_args()
    from adaspec.demo import DEMO_HEAD, DEMO_TARGET
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(DEMO_TARGET), draft=str(DEMO_HEAD), speculation="auto", num_steps=a.num_steps, device=dev,
              max_num_seqs=1)
    pol = llm.engine.policy
    rng = random.Random(a.seed)
    state = {"depth": 0, "left": 0, "pos": 0, "prev": 0}
    decided: list[tuple[int, int, int]] = []   # (depth, place in run, depth before the run)
    records = []

    def decide(batch_size, catchup_tokens=0):
        if state["left"] == 0:
            state["prev"], state["depth"] = state["depth"], rng.randint(0, a.num_steps)
            state["left"], state["pos"] = rng.choice((1, 2, 3, 5, 10, 30)), 0
        state["left"] -= 1
        state["pos"] += 1
        decided.append((state["depth"], state["pos"], state["prev"]))
        return pol.shapes[state["depth"]]

    def observe(fb):
        d, pos, prev = decided.pop(0) if decided else (-1, 0, 0)
        records.append({"depth": len(fb.drafted_per_position), "decided": d, "pos": pos, "prev": prev,
                        "cost_ms": round(fb.step_time * 1e3, 4), "prefill": fb.num_prefill_tokens,
                        "batch": fb.batch_size})

    pol.decide, pol.observe = decide, observe
    pool = [json.loads(line)["prompt"] for line in open(a.dataset) if line.strip()]
    prompts = [pool[i % len(pool)] for i in range(a.num_prompts)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    steady = [r for r in records if r["prefill"] == 0 and r["batch"] == 1]
    base = [r["cost_ms"] for r in steady if r["decided"] == 0 and r["pos"] >= 4]
    ref = statistics.median(base) if base else float("nan")
    summary = {}
    for d in range(a.num_steps + 1):
        row = {}
        for name, sel in (("1", lambda p: p == 1), ("2", lambda p: p == 2), ("3", lambda p: p == 3),
                          ("4+", lambda p: p >= 4)):
            xs = [r["cost_ms"] for r in steady if r["decided"] == d and sel(r["pos"])]
            row[name] = {"n": len(xs), "median_ms": round(statistics.median(xs), 4) if xs else None,
                         "p90_ms": round(sorted(xs)[int(0.9 * (len(xs) - 1))], 4) if xs else None}
        summary[d] = row
        cells = "  ".join(f"{k}: {v['median_ms'] if v['median_ms'] is not None else '-':>7} (n={v['n']:4d})"
                          for k, v in row.items())
        print(f"length {d}: {cells}", flush=True)
    print(f"steady length-0 median {ref:.4f} ms; {len(records)} steps, {tokens} tokens in {wall:.1f} s")
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(a), "summary": summary,
           "steady_off_median_ms": ref, "records": records}
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
