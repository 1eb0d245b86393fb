#!/usr/bin/env python3
"""Long prompts next to running streams (issue 23, item 5), on the offline engine.

A light stream decodes; at step 20, 8 prompts of --long-len tokens arrive at once; 5 steps
later a short request arrives. Reported per run: the light stream's worst and median
inter-token gap before and while the long prompts prefill, and the short request's time to
first token. Runs twice in the same process: paced (`--long-prefill-token-threshold`, default 0:
the scheduler's measured pacing) and unpaced (the threshold at the whole step budget, 8192:
prefill takes what decode rows leave, as before the pacer), so the ratios compare like with like.

    python3 benchmarks/long_prompt_stall.py [--device cpu] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from adaspec.demo import DEMO_HEAD, DEMO_TARGET
from adaspec.engine.engine import Engine
from adaspec.sampling import SamplingParams


def run(args, threshold: int) -> dict:
    kw = dict(device=args.device, long_prefill_token_threshold=threshold, policy=args.speculation)
    if args.model is None:
        kw["draft"] = str(DEMO_HEAD)
    elif args.draft:
        kw["draft"] = args.draft
    eng = Engine.from_kwargs(args.model or str(DEMO_TARGET), **kw)
    V = eng.vocab_size
    greedy = dict(temperature=0.0, ignore_eos=True)
    light = eng.add_request("light", [(7 * i) % V for i in range(32)], SamplingParams(max_tokens=args.light_tokens, **greedy))
    times, first_short, t_short = [], None, None
    step = 0
    while eng.has_unfinished():
        if step == 20:
            for k in range(8):
                eng.add_request(f"long{k}", [(k * 31 + 3 * i) % V for i in range(args.long_len)],
                                SamplingParams(max_tokens=8, **greedy))
            t_long = time.perf_counter()
        if step == 25:
            eng.add_request("short", [(5 * i + 1) % V for i in range(24)], SamplingParams(max_tokens=4, **greedy))
            t_short = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id == light and o.new_token_ids:
                times.append((now, step))
            if o.request_id == "short" and o.new_token_ids and first_short is None:
                first_short = now - t_short
        step += 1
    gaps = [(b[0] - a[0], b[1]) for a, b in zip(times, times[1:])]
    before = [g for g, s in gaps if s < 20]
    during = [g for g, s in gaps if 20 <= s]
    return {"threshold": threshold, "steps": step,
            "gap_before_ms": {"median": 1e3 * statistics.median(before), "max": 1e3 * max(before)},
            "gap_during_ms": {"median": 1e3 * statistics.median(during), "max": 1e3 * max(during)},
            "short_ttft_ms": 1e3 * first_short if first_short is not None else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the bundled demo pair")
    p.add_argument("--draft", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--speculation", default="always")
    p.add_argument("--long-len", type=int, default=2040)
    p.add_argument("--light-tokens", type=int, default=160)
    p.add_argument("--threshold", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    res = {"capped": run(args, args.threshold), "uncapped": run(args, 8192)}
    c, u = res["capped"], res["uncapped"]
    for name, r in res.items():
        print(f"{name:9s} gap before {r['gap_before_ms']['median']:7.1f} / {r['gap_before_ms']['max']:7.1f} ms  "
              f"during {r['gap_during_ms']['median']:7.1f} / {r['gap_during_ms']['max']:7.1f} ms (median / max)  "
              f"short TTFT {r['short_ttft_ms']:8.1f} ms")
    res["worst_gap_during_over_before"] = {k: r["gap_during_ms"]["max"] / r["gap_before_ms"]["max"] for k, r in
                                           (("capped", c), ("uncapped", u))}
    print("worst gap during / before: capped %.2fx, uncapped %.2fx" % tuple(res["worst_gap_during_over_before"].values()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
