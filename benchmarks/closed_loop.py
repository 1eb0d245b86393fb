#!/usr/bin/env python3
"""Offline closed loop: C clients, each sending its next request (random `--input-len` prompt,
`--output-len` tokens, greedy, EOS ignored) as soon as its last one finishes, straight on the
engine (no server), so that prefill is pending in most steps, as in a served load. Per
configuration of the prefill pacer (`--thresholds`: long_prefill_token_threshold values; 0 =
paced by measurement, the default; the step budget = unpaced):

    output tok/s, steps, the share of steps with prefill rows, the median time of steps with
    and without them, time to first token (mean / p99) and time per output token (mean)

with the ratios against the first configuration of the same run. Writes JSON.

    python3 benchmarks/closed_loop.py --concurrency 64 --requests 320 --thresholds 0,8192 --out cl.json
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


def run(llm: LLM, C: int, n: int, input_len: int, output_len: int, vocab: int, seed: int = 0) -> dict:
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    sent = {}
    first, done, tpot = {}, {}, []
    steps, prefill_steps, spans = 0, 0, {True: [], False: []}

    def send():
        rid = f"cl{len(sent)}"
        eng.add_request(rid, torch.randint(0, vocab, (input_len,), generator=g).tolist(), sp)
        sent[rid] = time.perf_counter()

    for _ in range(min(C, n)):
        send()
    t0 = time.perf_counter()
    while eng.has_unfinished():
        pre = any(r.num_computed < r.num_prompt_tokens for r in eng.scheduler.running) or bool(eng.scheduler.waiting)
        ts = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        steps += 1
        prefill_steps += pre
        spans[pre].append(now - ts)
        for o in outs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                done[o.request_id] = now
                k = len(o.token_ids)
                if k > 1:
                    tpot.append((now - first[o.request_id]) / (k - 1))
                if len(sent) < n:
                    send()
    wall = time.perf_counter() - t0
    ttft = sorted(first[r] - sent[r] for r in first)

    def med(x):
        return sorted(x)[len(x) // 2] * 1e3 if x else None

    return {"concurrency": C, "requests": len(done), "seconds": wall,
            "output_tok_s": len(done) * output_len / wall, "steps": steps,
            "prefill_step_share": prefill_steps / max(1, steps),
            "median_step_ms_with_prefill": med(spans[True]), "median_step_ms_decode_only": med(spans[False]),
            "mean_ttft_ms": sum(ttft) / len(ttft) * 1e3, "p99_ttft_ms": ttft[int(0.99 * (len(ttft) - 1))] * 1e3,
            "mean_tpot_ms": sum(tpot) / len(tpot) * 1e3 if tpot else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--thresholds", default="0,8192",
                   help="long_prefill_token_threshold per configuration (0: paced by measurement)")
    p.add_argument("--out", default="closed_loop.json")
    a = p.parse_args(argv)
    model, _ = write_shape_dirs(a.shape)
    vocab = SHAPES[a.shape][0]["vocab_size"]
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else a.device, "shape": a.shape,
           "args": vars(a), "runs": {}}
    for th in [int(x) for x in a.thresholds.split(",")]:
        llm = LLM(model, device=a.device, dtype="bfloat16" if a.device == "cuda" else "float32",
                  load_format="dummy", max_num_seqs=a.concurrency, enable_prefix_caching=False,
                  long_prefill_token_threshold=th)
        run(llm, a.concurrency, min(a.concurrency, 8), a.input_len, 8, vocab, seed=99)   # warm-up
        r = run(llm, a.concurrency, a.requests, a.input_len, a.output_len, vocab)
        res["runs"][str(th)] = r
        print(f"threshold {th}: {r}", flush=True)
        del llm
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
        Path(a.out).write_text(json.dumps(res, indent=1))
    ref = next(iter(res["runs"].values()))
    res["ratios_vs_first"] = {k: {"output_tok_s": v["output_tok_s"] / ref["output_tok_s"],
                                  "mean_tpot_ms": (v["mean_tpot_ms"] or 0) / (ref["mean_tpot_ms"] or 1)}
                              for k, v in res["runs"].items()}
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res["ratios_vs_first"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
