"""What a grammar on every request costs: offline throughput of the 8B shape (dummy weights,
EAGLE-3 chain of 3, simulated acceptance 0.7) at concurrency 64, with a json_schema on every
request against the same requests without one, measured in one run on one warm engine
(order: plain, grammar, plain, grammar; the ratio uses the best of each). Target: >= 0.9x.

The shape has no tokenizer, so the grammar runs over a raw vocabulary of the shape's size:
structural tokens ({ } [ ] " : , digits) and word pieces that are legal inside a JSON string.
The schema's free string field is where the output spends its tokens, as real JSON outputs
do. Simulated acceptance never emits a token the grammar forbids: a forbidden draft on the
path it takes is first replaced by a legal one (structured/bitmask.py, `legalize`), as a head
trained on the target would have proposed one, so acceptance does not hang on how many of a
dummy head's random tokens happen to be legal (session 6 measured 0.885x before that).

    python benchmarks/structured_h200.py --json benchmarks/results/structured_h200.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "body", "n"],
          "properties": {"title": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "body": {"type": "string"}}}


def raw_vocab(n: int) -> list[str]:
    structural = (list('{}[]":, ') + [str(d) for d in range(10)] + [chr(c) for c in range(97, 123)]
                  + ["title", "body", "</s>"])
    return structural + [f"w{i}" for i in range(n - len(structural))]


def run(llm, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    bad = [o for o in outs if o.error]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0].error}")
    return dt, sum(len(o.token_ids) for o in outs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--json", default="benchmarks/results/structured_h200.json")
    p.add_argument("--shape", default="llama-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()

    import random

    from adaspec import LLM, SamplingParams
    from adaspec.bench.shapes import write_shape_dirs
    from adaspec.structured import StructuredOutput
    from adaspec.structured.grammar import GrammarCache

    target, draft = write_shape_dirs(a.shape)
    llm = LLM(target, draft=draft, load_format="dummy", device=a.device, dtype=a.dtype, max_num_seqs=a.concurrency,
              speculation="always", num_steps=3, spec_simulate_accept_rate=0.7,
              enable_prefix_caching=False)   # every run prefills its prompts (not only the first)
    vocab = llm.engine.vocab_size
    pieces = raw_vocab(vocab)
    llm.engine.grammars = GrammarCache.from_vocab(pieces, stop_token_ids=[pieces.index("</s>")])
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    plain = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    spec = StructuredOutput.json_schema(SCHEMA)
    gram = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True, structured=spec)
    run(llm, prompts[:a.concurrency], plain)       # warm-up, both paths
    run(llm, prompts[:a.concurrency], gram)
    # Host time of the grammar steps' second half (the bitmask: draft readback, xgrammar, copy),
    # which runs while the step's target forward does.
    gm = llm.engine.runner.grammar_masks
    host = {"seconds": 0.0, "calls": 0}
    masks = gm.masks

    def timed_masks(*args):
        t0 = time.perf_counter()
        try:
            return masks(*args)
        finally:
            host["seconds"] += time.perf_counter() - t0
            host["calls"] += 1

    gm.masks = timed_masks
    res = {"plain": [], "grammar": []}
    for name, sp in (("plain", plain), ("grammar", gram), ("plain", plain), ("grammar", gram)):
        st0 = llm.stats()
        dt, toks = run(llm, prompts, sp)
        st = {k: llm.stats()[k] - st0[k] for k in ("num_steps", "verify_steps", "accepted_tokens")}
        steps = st["num_steps"]
        # Tokens per request and step: about the same with a grammar (its forbidden drafts are
        # replaced by legal ones before simulated acceptance, see the docstring).
        per = 1 + st["accepted_tokens"] / max(1, st["verify_steps"])
        res[name].append({"seconds": dt, "output_tokens": toks, "tok_s": toks / dt, "steps": steps,
                          "ms_per_step": 1e3 * dt / steps, "tokens_per_verify": per})
        print(f"{name:8s} {toks} tokens in {dt:.2f} s = {toks / dt:.0f} tok/s ({1e3 * dt / steps:.2f} ms/step, "
              f"{per:.2f} tokens per request-step)")
    best = {k: max(r["tok_s"] for r in v) for k, v in res.items()}
    ratio = best["grammar"] / best["plain"]
    step_ratio = min(r["ms_per_step"] for r in res["plain"]) / min(r["ms_per_step"] for r in res["grammar"])
    out = {"shape": a.shape, "concurrency": a.concurrency, "num_prompts": a.num_prompts,
           "input_len": a.input_len, "output_len": a.output_len, "simulated_accept_rate": 0.7,
           "runs": res, "best_tok_s": best, "grammar_over_plain": ratio, "target": 0.9,
           "step_time_plain_over_grammar": step_ratio,
           "mask_host_ms_per_grammar_step": 1e3 * host["seconds"] / max(1, host["calls"]),
           "stats": {k: v for k, v in llm.stats().items() if isinstance(v, (int, float, str))}}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"grammar / plain throughput: {ratio:.3f}x (target >= 0.9x); step time plain / grammar: {step_ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
