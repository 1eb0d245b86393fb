"""Offline engine sweep: output tokens/s of each speculation policy at several batch sizes,
with ratios against `off` measured in the same run. Writes JSON.

    python benchmarks/engine_sweep.py --shape llama-8b --device cuda --policies off,always,auto \
        --batches 1,4,16,64 --accept-rate 0.8 --out result.json

`--shape llama-8b` writes a config of Llama-3.1-8B's shape and runs with random weights
(`load_format=dummy`) and a simulated acceptance rate (each draft token accepted with
probability A given its predecessor was): the cost side is real, the acceptance is not.
`--model DIR --draft DIR` runs real checkpoints instead.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from adaspec import LLM, SamplingParams
from adaspec.bench.shapes import SHAPES, write_shape_dirs
from gpu_fast_path import _GcClock   # (benchmarks/: the fast-path steps' collector clock)

def timed_generate(llm: LLM, prompts: list, sp: SamplingParams, warm_up: SamplingParams, n_warm: int = 1) -> dict:
    """`llm.generate(prompts, sp)` after a warm-up on the first `n_warm` prompts: seconds,
    output tokens and tok/s, acceptance length and the draft lengths the steps used (from the
    difference of `llm.stats()` around the timed call)."""
    llm.generate(prompts[:n_warm], warm_up)
    before = llm.stats()
    gcc = _GcClock()   # time in Python's collector: a full collection pauses every request
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t0
    finally:
        gcc.stop()
    st = llm.stats()
    steps = st["verify_steps"] - before["verify_steps"]
    acc = st["accepted_tokens"] - before["accepted_tokens"]
    hist = {k: v - before["draft_len_histogram"].get(k, 0) for k, v in st["draft_len_histogram"].items()}
    n = sum(len(o.token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt,
            "accept_length": (steps + acc) / steps if steps else None,
            "draft_len_histogram": {k: v for k, v in hist.items() if v},
            "gc_seconds": gcc.ms / 1e3, "gc_collections": list(gcc.count)}


def run(llm: LLM, batch: int, input_len: int, output_len: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (input_len,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return {"batch": batch, **timed_generate(llm, prompts, sp, warm)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None)
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--policies", default="off,always,auto")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--accept-rate", type=float, default=0.8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--out", default="engine_sweep.json")
    a = p.parse_args(argv)
    extra = {}
    if a.shape:
        tcfg = SHAPES[a.shape][0]
        a.model, a.draft = write_shape_dirs(a.shape)
        extra = dict(load_format="dummy", spec_simulate_accept_rate=a.accept_rate)
        vocab = tcfg["vocab_size"]
    else:
        vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    batches = [int(x) for x in a.batches.split(",")]
    results: dict[str, list] = {}
    for policy in a.policies.split(","):
        # "name" or "name:tree" (the 16-token tree: topk 4, 2 steps) or "name:chainK"
        name, _, shape = policy.partition(":")
        shape_kw = dict(num_steps=a.num_steps)
        if shape == "tree":
            shape_kw = dict(num_steps=2, topk=4, num_draft_tokens=16)
        elif shape.startswith("chain"):
            shape_kw = dict(num_steps=int(shape[5:]))
        llm = LLM(a.model, draft=a.draft if name != "off" else None, speculation=name, device=a.device,
                  dtype=a.dtype, kv_cache_memory=a.kv_cache_memory, max_num_seqs=max(batches), **shape_kw,
                  **(extra if name != "off" else {"load_format": extra.get("load_format", "auto")}))
        results[policy] = [run(llm, b, a.input_len, a.output_len, vocab, seed=b) for b in batches]
        for r in results[policy]:
            print(f"{policy:>8} b={r['batch']:>4} {r['output_tok_s']:9.1f} tok/s  accept={r['accept_length']}  "
                  f"hist={r['draft_len_histogram']}", flush=True)
        del llm
        import gc
        gc.collect()  # the engine holds reference cycles: free its KV cache before the next one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("\noutput tok/s, ratio to off (same run)")
    print("batch " + " ".join(f"{p:>16}" for p in results))
    for i, b in enumerate(batches):
        base = results["off"][i]["output_tok_s"] if "off" in results else None
        cells = []
        for pol in results:
            v = results[pol][i]["output_tok_s"]
            cells.append(f"{v:9.1f} ({v / base:4.2f}x)" if base else f"{v:9.1f}")
        print(f"{b:>5} " + " ".join(f"{c:>16}" for c in cells))
    Path(a.out).write_text(json.dumps({"args": vars(a), "simulated_accept_rate": extra.get("spec_simulate_accept_rate"),
                                       "results": results}, indent=2))
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
