"""What a short prompt's first step costs on a host-bound pair (issue 19: the demo pair served at
concurrency 1 spends 5-11 ms on each request's prefill step, 13x a decode step).

    python3 benchmarks/prefill_profile.py --configs off,chain8 --out prefill.json

For each configuration (the bundled demo pair): `--requests` requests, one at a time, each
prompt `--prompt-len` held-out tokens and 4 output tokens; every engine step's wall time is
recorded with the number of prompt rows it ran. Then the same under cProfile (host functions by
own time) and one prefill step under torch.profiler (kernels launched, device busy time).
Prints the median prefill step against the median decode step and writes JSON.
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

CONFIGS = {"off": {}, "chain8": dict(speculation="always", num_steps=8), "auto8": dict(speculation="auto", num_steps=8)}


def prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    """Token ids of held-out prompts, cut or repeated to `length`."""
    tok = llm.tokenizer
    out = []
    with open("tests/data/demo_heldout.jsonl") as f:
        texts = [json.loads(line)["prompt"] for line in f]
    for i in range(n):
        ids = tok.encode(texts[i % len(texts)])
        while len(ids) < length:
            ids = ids + ids
        out.append(ids[:length])
    return out


def run(llm: LLM, reqs: list[list[int]], tag: str) -> None:
    """Serve `reqs` one after another (4 output tokens each)."""
    eng = llm.engine
    for i, p in enumerate(reqs):
        eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()


def measure(llm: LLM, args) -> dict:
    eng = llm.engine
    reqs = prompts(llm, args.requests, args.prompt_len)
    rows = []
    orig = eng.scheduler.schedule

    def schedule():   # note each plan's prompt rows
        plan = orig()
        rows.append(sum(s.num_rows for s in plan.scheduled if s.num_rows > 1))
        return plan

    eng.scheduler.schedule = schedule
    run(llm, reqs[:4], "warm")
    rows.clear()
    t = []
    for i, p in enumerate(reqs):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished():
            n = len(rows)
            t0 = time.perf_counter()
            eng.step()
            t.append((rows[n] if len(rows) > n else 0, 1e3 * (time.perf_counter() - t0)))
    pre = sorted(ms for r, ms in t if r > 0)
    dec = sorted(ms for r, ms in t if r == 0)
    pr = cProfile.Profile()
    pr.enable()
    run(llm, reqs[:20], "prof")
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
    kern = None
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile
        eng.add_request("k", reqs[0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            wall = 1e3 * (time.perf_counter() - t0)
        while eng.has_unfinished():
            eng.step()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
        names: dict[str, int] = {}
        for e in ev:
            names[e.name[:60]] = names.get(e.name[:60], 0) + 1
        busy = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) for e in ev) / 1e3
        calls: dict[str, list] = {}
        for e in cpu:
            c = calls.setdefault(e.name[:60], [0, 0.0])
            c[0] += 1
            c[1] += e.cpu_time_total / 1e3
        kern = {"wall_ms": wall, "kernels": len(ev), "device_busy_ms": busy,
                "kernel_names": sorted(names.items(), key=lambda kv: -kv[1])[:25],
                "host_calls": sorted(([k, v[0], round(v[1], 3)] for k, v in calls.items()), key=lambda x: -x[2])[:40]}
    return {"prefill_ms_p10_p50_p90": [pre[len(pre) * q // 10] for q in (1, 5, 9)] if pre else None,
            "decode_ms_p10_p50_p90": [dec[len(dec) * q // 10] for q in (1, 5, 9)] if dec else None,
            "num_prefill_steps": len(pre), "num_decode_steps": len(dec), "kernel_profile": kern,
            "host_profile": s.getvalue()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="off,chain8")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default="prefill_profile.json")
    args = ap.parse_args()
    from adaspec.demo import DEMO_HEAD, DEMO_TARGET
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "configs": {}}
    for c in args.configs.split(","):
        kw = dict(CONFIGS[c])
        if kw:
            kw["draft"] = str(DEMO_HEAD)
        llm = LLM(str(DEMO_TARGET), device="cuda" if torch.cuda.is_available() else "cpu", **kw)
        r = res["configs"][c] = measure(llm, args)
        k = r["kernel_profile"]
        print(f"{c}: prefill step ms p10/50/90 {r['prefill_ms_p10_p50_p90']}, decode {r['decode_ms_p10_p50_p90']}"
              + (f"; one prefill step: {k['kernels']} kernels, device busy {k['device_busy_ms']:.3f} ms, "
                 f"wall {k['wall_ms']:.3f} ms" if k else ""), flush=True)
        llm.close()
        del llm
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for c, r in res["configs"].items():
        print(f"==== {c}\n{r['host_profile'][:5000]}")
        if r["kernel_profile"]:
            print(json.dumps(r["kernel_profile"]["kernel_names"]), "\n", json.dumps(r["kernel_profile"]["host_calls"][:25]))


if __name__ == "__main__":
    main()
