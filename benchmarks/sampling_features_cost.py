"""What logprobs and penalties cost under speculation (issue 24): offline output tokens/s at
one concurrency with every request plain, with `logprobs` on every request, and with
penalties (frequency + presence + repetition + logit_bias) on every request; ratios against
the plain run measured in the same process. Writes JSON.

    python benchmarks/sampling_features_cost.py --shape llama-8b --batch 64 --out sampling_cost.json

`--shape llama-8b`: Llama-3.1-8B's shape with random weights (`load_format=dummy`) and a
simulated acceptance rate (the cost side is real, the acceptance is not); greedy requests, so
the plain and logprobs runs replay the post-forward CUDA graphs (logprobs: the graphs that
compute every row's), and the penalties run it eagerly.
Target (issue 24): logprobs cost at most 5% (ratio >= 0.95).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from adaspec import LLM, SamplingParams
from adaspec.bench.shapes import SHAPES, write_shape_dirs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_sweep import timed_generate  # noqa: E402

VARIANTS = {
    "plain": {},
    "logprobs5": dict(logprobs=5),
    "logprobs0": dict(logprobs=0),
    "penalties": dict(frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.1, logit_bias={11: 1.0}),
}


def run(llm: LLM, prompts: list, output_len: int, extra: dict) -> dict:
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, **extra)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **extra)
    return timed_generate(llm, prompts, sp, warm, n_warm=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--accept-rate", type=float, default=0.8)
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--waves", type=int, default=1, help="requests per run = waves x batch (longer, steadier runs)")
    p.add_argument("--out", default="sampling_features_cost.json")
    a = p.parse_args(argv)
    model, draft = write_shape_dirs(a.shape)
    vocab = SHAPES[a.shape][0]["vocab_size"]
    llm = LLM(model, draft=draft, speculation="always", num_steps=a.num_steps, device=a.device,
              load_format="dummy", spec_simulate_accept_rate=a.accept_rate, max_num_seqs=a.batch,
              # every run prefills its prompts: with the prefix cache the first run alone would
              # (the cause of a first plain run ~30% slower than the rest in calls 1-4)
              enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (a.input_len,), generator=g).tolist() for _ in range(a.batch * a.waves)]
    results: dict[str, list] = {k: [] for k in VARIANTS}
    for _ in range(a.repeats):   # interleaved, so drift hits every variant alike
        for name, extra in VARIANTS.items():
            results[name].append(run(llm, prompts, a.output_len, extra))
    best = {k: max(r["output_tok_s"] for r in v) for k, v in results.items()}
    ratios = {k: best[k] / best["plain"] for k in VARIANTS}
    out = {"args": vars(a), "results": results, "best_output_tok_s": best, "ratio_vs_plain": ratios,
           "logprobs_within_5pct": ratios["logprobs5"] >= 0.95}
    print(json.dumps({"best_output_tok_s": best, "ratio_vs_plain": ratios}, indent=1))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
