"""`python -m adaspec.bench.offline`: offline `LLM.generate` throughput on exactly the
requests one `adaspec compare` level sends (same dataset, seed and indices), no server.

It is the reference a server is measured against: server output tok/s at a level divided by
this on the same requests tells what the HTTP layer, streaming and the async engine cost.
The engine gets the same flags as `adaspec serve` (so `--max-num-seqs` bounds the running
batch as the closed loop's concurrency does). Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from adaspec.bench.datasets import load_dataset


def main(argv: list[str] | None = None) -> int:
    from adaspec.config import add_engine_cli_args, engine_kwargs_from_cli

    p = argparse.ArgumentParser(prog="python -m adaspec.bench.offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_cli_args(p)
    p.add_argument("--input-len", type=int, required=True)
    p.add_argument("--output-len", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=True, help="random token ids below this")
    p.add_argument("--num-prompts", type=int, required=True)
    p.add_argument("--first-prompt", type=int, required=True,
                   help="dataset index of the first request (the level's `first_prompt`)")
    p.add_argument("--num-warmup", type=int, default=2,
                   help="uncounted warm-up requests (dataset indices 0.., 16 output tokens)")
    p.add_argument("--json", required=True, help="write the result here")
    a = p.parse_args(argv)
    if a.model is None:
        p.error("--model is required")

    from adaspec import LLM, SamplingParams

    ds = load_dataset("random", input_len=a.input_len, output_len=a.output_len, range_ratio=0.0,
                      seed=a.seed, vocab_size=a.vocab_size, count_tokens=None)
    samples = ds.sample(a.num_prompts, a.first_prompt)
    t0 = time.perf_counter()
    llm = LLM(a.model, **engine_kwargs_from_cli(a))
    startup = time.perf_counter() - t0
    if a.num_warmup:
        warm = [s.prompt for s in ds.sample(a.num_warmup, 0)]
        llm.generate(warm, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=s.output_len, temperature=0.0, ignore_eos=True) for s in samples]
    t0 = time.perf_counter()
    outs = llm.generate([s.prompt for s in samples], params)
    seconds = time.perf_counter() - t0
    out_tokens = sum(len(o.token_ids) for o in outs)
    in_tokens = sum(s.prompt_len for s in samples)
    res = {"tool": "adaspec.bench.offline", "command": " ".join([sys.executable, "-m", "adaspec.bench.offline",
                                                                 *(argv if argv is not None else sys.argv[1:])]),
           "num_requests": len(samples), "first_prompt": a.first_prompt, "input_tokens": in_tokens,
           "output_tokens": out_tokens, "seconds": seconds, "output_tok_s": out_tokens / seconds,
           "total_tok_s": (in_tokens + out_tokens) / seconds, "startup_s": startup,
           "max_num_seqs": a.max_num_seqs, "stats": _jsonable(llm.stats())}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(f"LLM.generate: {len(samples)} requests, {out_tokens} output tokens in {seconds:.2f} s = "
          f"{res['output_tok_s']:.1f} tok/s")
    return 0


def _jsonable(obj):
    try:
        return json.loads(json.dumps(obj, default=str))
    except (TypeError, ValueError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
