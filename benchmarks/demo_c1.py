"""The bundled demo pair at concurrency 1, offline (issue 19): tok/s of each configuration
against speculation off measured in the same run, without the server in the way.

    python3 benchmarks/demo_c1.py --configs off,chain4,tree,auto,auto-tree --rounds 2 --out demo_c1.json

Every configuration gets a fresh engine (graphs captured, kernels warmed), two warm-up
requests, then the held-out prompts (`tests/data/demo_heldout.jsonl`) one after another,
`--repeat` times, greedy, `--output-len` tokens each (prefill included in the time, as a
client at concurrency 1 sees it). `--rounds 2` runs the whole list twice in order, so two
runs of one configuration show the noise. Per configuration: output tok/s, the ratio to the
mean `off` of the run, acceptance length, the draft-length histogram, how the step parts
ran (`launches`: graph or eager), the host's milliseconds per step by part, and the median engine step time per draft length.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from adaspec import LLM, SamplingParams
from adaspec.demo import DEMO_HEAD, DEMO_TARGET

TREE = dict(num_steps=6, topk=4, num_draft_tokens=16)
CONFIGS = {
    "off": {},
    "chain3": dict(speculation="always", num_steps=3),
    "chain4": dict(speculation="always", num_steps=4),
    "chain6": dict(speculation="always", num_steps=6),
    "tree": dict(speculation="always", **TREE),
    "tree-s4": dict(speculation="always", num_steps=4, topk=4, num_draft_tokens=16),
    "auto": dict(speculation="auto", num_steps=4),
    "auto6": dict(speculation="auto", num_steps=6),
    "auto-tree": dict(speculation="auto", **TREE),
}
HELDOUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "demo_heldout.jsonl"


def run(config: str, prompts: list[str], args) -> dict:
    kw = dict(CONFIGS[config])
    if kw:
        kw["draft"] = str(DEMO_HEAD)
    llm = LLM(str(DEMO_TARGET), device=args.device, **kw)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for p in prompts[:2]:
        llm.generate([p], params)
    eng = llm.engine
    base = llm.stats()
    host0, decide0, steps0 = dict(eng.host_times), eng.scheduler.decide_seconds, eng.counters["num_steps"]
    by_len: dict[int, list[float]] = defaultdict(list)
    step = eng.step

    def timed_step():   # the engine's own step time, per draft length of the step collected
        out = step()
        by_len[eng.last_draft_len].append(eng.runner.last_step_time * 1e3)
        return out

    eng.step = timed_step
    tokens, t0 = 0, time.perf_counter()
    for _ in range(args.repeat):
        for p in prompts:
            out = llm.generate([p], params)
            tokens += len(out[0].token_ids)
    wall = time.perf_counter() - t0
    del eng.step
    st = llm.stats()
    n = max(1, eng.counters["num_steps"] - steps0)
    host = {k: round(1e3 * (v - host0.get(k, 0.0)) / n, 4) for k, v in eng.host_times.items()}
    host["decide"] = round(1e3 * (eng.scheduler.decide_seconds - decide0) / n, 4)
    launches = {k: v - base.get("launches", {}).get(k, 0) for k, v in st.get("launches", {}).items()}
    hist = {int(k): v - base["draft_len_histogram"].get(k, 0) for k, v in st["draft_len_histogram"].items()}
    res = {"config": config, "tok_s": tokens / wall, "tokens": tokens, "seconds": wall,
           "accept_length": st.get("accept_length"), "draft_len_histogram": hist, "launches": launches,
           "median_step_ms": {d: statistics.median(v) for d, v in sorted(by_len.items())},
           "steps": {d: len(v) for d, v in sorted(by_len.items())}, "host_ms_per_step": host,
           "policy_state": st.get("policy_state")}
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="off,chain4,tree,auto,auto-tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="passes over the held-out prompts per run")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="demo_c1.json")
    args = ap.parse_args()
    prompts = [json.loads(line)["prompt"] for line in HELDOUT.read_text().splitlines() if line.strip()]
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {sorted(CONFIGS)}")
    runs = []
    for r in range(args.rounds):
        for c in configs:
            res = run(c, prompts, args)
            res["round"] = r
            runs.append(res)
            print(f"round {r} {c:10s} {res['tok_s']:8.1f} tok/s  acc {res['accept_length']}  "
                  f"hist {res['draft_len_histogram']}  step ms {res['median_step_ms']}  launches {res['launches']}  host ms {res['host_ms_per_step']}",
                  flush=True)
    off = [x["tok_s"] for x in runs if x["config"] == "off"]
    ref = statistics.mean(off) if off else None
    summary = {}
    for c in configs:
        v = [x["tok_s"] for x in runs if x["config"] == c]
        summary[c] = {"tok_s": v, "mean": statistics.mean(v), "x_off": statistics.mean(v) / ref if ref else None,
                      "spread": (max(v) - min(v)) / statistics.mean(v)}
        print(f"{c:10s} mean {summary[c]['mean']:8.1f} tok/s  x off {summary[c]['x_off'] or float('nan'):.3f}  "
              f"spread {summary[c]['spread']:.3f}", flush=True)
    out = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "runs": runs,
           "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
