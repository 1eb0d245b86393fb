"""What a short prompt's first step costs on a host-bound pair (issue 19: the demo pair served at
concurrency 1 spends 5-11 ms on each request's prefill step, 13x a decode step).

    python3 benchmarks/prefill_profile.py --configs off,chain8 --out prefill.json

For each configuration (the bundled demo pair, or with `--shape` a benchmark shape: bf16 random
weights, random prompts, no prefix caching, so each prompt step computes the whole prompt; e.g.
`--shape qwen3-30b-a3b --prompt-len 512`, whose eager prompt step issue 20's session 18 priced
at ~58 ms): `--requests` requests, one at a time, each prompt `--prompt-len` held-out tokens and
4 output tokens; every engine step's wall time is
recorded with the number of prompt rows it ran. Then the same under cProfile (host functions by
own time), and one prompt step under torch.profiler: its kernels and device time
(`gpu_fast_path.profile_steps`), and another's CUDA runtime calls (`launch_anatomy.runtime_calls`).
Prints the median prefill step against the median decode step and writes JSON. `--configs`
takes launch_anatomy's names: off, chainK, autoK, each also as NAME-eager (`--cuda-graph-max-tokens
0`: prompt steps run eagerly, decode steps keep their graphs; `adaspec/engine/cuda_graph.py`).
The JSON also says how far the token graphs went (`token_graph_rows`: the largest captured) and
what capture took.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import time

import torch

from adaspec import LLM, SamplingParams
from gpu_fast_path import profile_steps   # (benchmarks/: a kernel profile of engine steps)
from launch_anatomy import config_kwargs, runtime_calls   # (the demo configurations; CUDA runtime calls)

from adaspec.bench.shapes import SHAPES, write_shape_dirs


def prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    """Token ids of held-out prompts, cut or repeated to `length` (a model without a tokenizer,
    a `--shape`: random ids, distinct per prompt, so no prefix-cache hit)."""
    tok = llm.tokenizer
    if tok is None:
        rng = random.Random(0)
        vocab = llm.engine.runner.model_spec.vocab_size
        return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]
    out = []
    with open("tests/data/demo_heldout.jsonl") as f:
        texts = [json.loads(line)["prompt"] for line in f]
    for i in range(n):
        ids = tok.encode(texts[i % len(texts)])
        while len(ids) < length:
            ids = ids + ids
        out.append(ids[:length])
    return out


def run(eng, reqs: list[list[int]], tag: str, rows: list[int], max_tokens: int = 4) -> list[tuple[int, float]]:
    """Serve `reqs` one after another; (prompt rows, wall ms) of every step (`rows`: the prompt
    rows of each plan scheduled, appended by the patched scheduler in `measure`)."""
    steps = []
    for i, p in enumerate(reqs):
        eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished():
            n = len(rows)
            t0 = time.perf_counter()
            eng.step()
            steps.append((rows[n] if len(rows) > n else 0, 1e3 * (time.perf_counter() - t0)))
    return steps


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
    run(eng, reqs[:4], "warm", rows)
    t = run(eng, reqs, "r", rows)
    pre = sorted(ms for r, ms in t if r > 0)
    dec = sorted(ms for r, ms in t if r == 0)
    pr = cProfile.Profile()
    pr.enable()
    run(eng, reqs[:20], "prof", rows)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
    kern = None
    if torch.cuda.is_available():   # a request's first step is its prompt's
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        eng.add_request("k0", reqs[0], sp)
        kern = profile_steps(eng, steps=1, top=25)
        while eng.has_unfinished():
            eng.step()
        eng.add_request("k1", reqs[1], sp)
        kern["runtime_calls"] = runtime_calls(eng, 1)
        while eng.has_unfinished():
            eng.step()
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
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="a benchmark shape (bf16, random weights, random prompts) instead of the demo pair")
    ap.add_argument("--out", default="prefill_profile.json")
    args = ap.parse_args()
    from adaspec.demo import DEMO_HEAD, DEMO_TARGET
    target, head, extra = str(DEMO_TARGET), str(DEMO_HEAD), {}
    if args.shape:
        target, head = write_shape_dirs(args.shape)
        # every prompt step computes its whole prompt: the measured runs repeat prompts
        extra = dict(load_format="dummy", dtype="bfloat16" if torch.cuda.is_available() else "float32",
                     enable_prefix_caching=False)
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "configs": {}}
    for c in args.configs.split(","):
        kw = config_kwargs(c.removesuffix("-eager"))
        if kw:
            kw["draft"] = head
        llm = LLM(target, device="cuda" if torch.cuda.is_available() else "cpu",
                  **(dict(cuda_graph_max_tokens=0) if c.endswith("-eager") else {}), **kw, **extra)
        graphs = llm.engine.runner.graphs
        r = res["configs"][c] = measure(llm, args)
        r.update(token_graph_rows=max(graphs.token_graphs, default=0) if graphs else 0,
                 capture_s=graphs.capture_seconds if graphs else 0.0)
        k = r["kernel_profile"]
        print(f"{c}: prefill step ms p10/50/90 {r['prefill_ms_p10_p50_p90']}, decode {r['decode_ms_p10_p50_p90']}, "
              f"token graphs up to {r['token_graph_rows']} rows, capture {r['capture_s']:.1f} s"
              + (f"; one prefill step: {k['kernels_per_step']:.0f} kernels, device busy "
                 f"{k['device_busy_ms_per_step']:.3f} ms, wall {k['wall_ms_per_step']:.3f} ms" if k else ""), flush=True)
        llm.close()
        del llm
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for c, r in res["configs"].items():
        print(f"==== {c}\n{r['host_profile'][:5000]}")
        if r["kernel_profile"]:
            print(json.dumps(r["kernel_profile"]["top_kernels"]), "\n", json.dumps(r["kernel_profile"]["runtime_calls"]))


if __name__ == "__main__":
    main()
