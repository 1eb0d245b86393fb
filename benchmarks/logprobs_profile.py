"""Where logprobs' cost goes (issue 24): the 8B shape (dummy weights, chain 3, simulated
acceptance 0.8) at b = 64, plain requests then requests with `logprobs=5`, each a short
steady run under torch.profiler. Prints, per variant, wall time per step, the device time
per step (CUDA kernels), and the top kernels and host functions; writes the tables as JSON.

    python benchmarks/logprobs_profile.py --out logprobs_profile.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from adaspec import LLM, SamplingParams
from adaspec.bench.shapes import SHAPES, write_shape_dirs


def profiled(llm: LLM, prompts: list, sp: SamplingParams, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    llm.generate(prompts, dataclasses.replace(sp, max_tokens=8))   # warm
    s0 = llm.stats()["num_steps"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    steps = llm.stats()["num_steps"] - s0
    ev = prof.key_averages()
    dev = sum(e.self_device_time_total for e in ev) / 1e3
    rows = lambda key: [{"name": e.key[:90], "ms_per_step": getattr(e, key) / 1e3 / steps, "calls": e.count}  # noqa: E731
                        for e in sorted(ev, key=lambda e: -getattr(e, key))[:top]]
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps, "device_ms_per_step": dev / steps,
            "top_device": rows("self_device_time_total"), "top_host": rows("self_cpu_time_total")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--out", default="logprobs_profile.json")
    a = p.parse_args(argv)
    model, draft = write_shape_dirs("llama-8b")
    vocab = SHAPES["llama-8b"][0]["vocab_size"]
    llm = LLM(model, draft=draft, speculation="always", num_steps=3, device="cuda", load_format="dummy",
              spec_simulate_accept_rate=0.8, max_num_seqs=a.batch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (256,), generator=g).tolist() for _ in range(a.batch)]
    out = {}
    for name, extra in (("plain", {}), ("logprobs5", dict(logprobs=5)), ("plain2", {})):
        sp = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True, **extra)
        out[name] = r = profiled(llm, prompts, sp, a.top)
        print(f"== {name}: {r['steps']} steps, wall {r['wall_ms_per_step']:.2f} ms/step, "
              f"device {r['device_ms_per_step']:.2f} ms/step")
        for kind in ("top_device", "top_host"):
            print(f"  {kind}:")
            for row in r[kind]:
                print(f"    {row['ms_per_step']:8.3f} ms/step  {row['calls']:6d}  {row['name']}")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
