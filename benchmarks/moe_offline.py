"""Offline throughput on a mixture-of-experts shape against its roofline bound and against
Hugging Face transformers' continuous batching (issue 20, target 2).

    python3 benchmarks/moe_offline.py --physics moe_physics.json --out moe_offline.json

N requests (default 256 x 512 in / 256 out, random prompts, greedy, ignore_eos), the shape's
config with random weights (`load_format=dummy`, bf16), speculation off, in a fresh process;
then the same requests through transformers' `generate_batch` on a model of the same config
with random weights, in a process of its own (the GPU holds one 61 GB model at a time).

The bound (`moe_physics_probe.py`'s JSON from the same call): prefill at the measured GEMM
rate (2 x active parameters x prompt tokens; attention FLOPs left out, so the bound is
optimistic), plus one decode step per output token at the roofline step of the batch
(`roofline_ms["{B}x1"]`, B = the batch the engine runs, per wave of B requests). Writes JSON
with both ratios; prints them.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

import torch



def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def vocab_of(shape: str) -> int:
    from adaspec.bench.shapes import SHAPES
    return min(SHAPES[shape][0]["vocab_size"], 128000)


def run_adaspec(a) -> dict:
    from adaspec import LLM, SamplingParams
    from adaspec.bench.shapes import write_shape_dirs
    target, _ = write_shape_dirs(a.shape)
    t0 = time.perf_counter()
    llm = LLM(target, load_format="dummy", device=a.device, dtype="bfloat16", max_num_seqs=a.batch,
              max_model_len=a.input_len + a.output_len + 16, enable_prefix_caching=False)
    start_s = time.perf_counter() - t0
    ps = prompts(a.requests, a.input_len, vocab_of(a.shape))
    llm.generate(ps[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    sp = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp)
    sync()
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    st = llm.stats()
    return {"output_tokens": n, "seconds": dt, "tok_s": n / dt, "start_s": start_s,
            "num_kv_blocks": st.get("num_total_blocks"), "steps": st.get("num_steps")}


def run_hf(a) -> dict:
    """transformers' continuous batching (`generate_batch`, paged attention) on random weights."""
    import transformers
    from transformers import GenerationConfig
    from adaspec.bench.shapes import SHAPES
    conf = dict(SHAPES[a.shape][0])
    cls = getattr(transformers, conf.pop("architectures")[0])   # the shape's config has no model_type
    conf.pop("torch_dtype", None)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(a.device):
        model = cls(cls.config_class(**conf))
    torch.set_default_dtype(torch.float32)
    model.eval()
    model.set_attn_implementation("paged|sdpa")
    start_s = time.perf_counter() - t0
    ps = prompts(a.requests, a.input_len, vocab_of(a.shape))
    gen = GenerationConfig(max_new_tokens=a.output_len, min_new_tokens=a.output_len, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate_batch(inputs=ps[:2], generation_config=GenerationConfig(max_new_tokens=4, do_sample=False,
                                                                              pad_token_id=0), progress_bar=False)
        sync()
        t0 = time.perf_counter()
        outs = model.generate_batch(inputs=ps, generation_config=gen, progress_bar=False)
        sync()
        dt = time.perf_counter() - t0
    n = sum(len(o.generated_tokens) for o in outs.values())
    return {"output_tokens": n, "seconds": dt, "tok_s": n / dt, "start_s": start_s}


def bound(physics: dict, a) -> dict:
    """The roofline bound of the run (see the module docstring)."""
    B = min(a.batch, a.requests)
    waves = math.ceil(a.requests / B)
    active_params = physics["active_GB_per_token"] * 1e9 / 2   # bf16 bytes -> parameters
    prefill_s = 2 * active_params * a.requests * a.input_len / (physics["gemm_TFLOPs"] * 1e12)
    step_ms = physics["roofline_ms"][f"{B}x1"]
    decode_s = waves * a.output_len * step_ms / 1e3
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_step_ms": step_ms, "batch": B,
            "tok_s": a.requests * a.output_len / (prefill_s + decode_s)}


def part(a, name: str) -> dict:
    """One part in a fresh process; its JSON (or the error)."""
    cmd = [sys.executable, __file__, "--part", name, "--shape", a.shape, "--device", a.device,
           "--requests", str(a.requests), "--batch", str(a.batch), "--input-len", str(a.input_len),
           "--output-len", str(a.output_len)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.timeout} s"}
    sys.stderr.write(p.stderr[-3000:])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if p.returncode == 0 and lines else {"error": (p.stderr or p.stdout)[-800:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--batch", type=int, default=256, help="max_num_seqs")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--physics", help="moe_physics_probe.py JSON of the same call (the bound)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--timeout", type=int, default=300, help="seconds per part")
    p.add_argument("--part", choices=["adaspec", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--out", default="moe_offline.json")
    a = p.parse_args(argv)
    if a.part:
        print(json.dumps(run_adaspec(a) if a.part == "adaspec" else run_hf(a)))
        return 0
    res = {"args": vars(a), "adaspec": part(a, "adaspec")}
    if not a.skip_hf:
        res["hf_cb"] = part(a, "hf")
    if a.physics:
        with open(a.physics) as f:
            res["bound"] = bound(json.load(f), a)
    ours = res["adaspec"].get("tok_s")
    if ours and "bound" in res:
        res["adaspec_over_bound"] = ours / res["bound"]["tok_s"]
    if ours and res.get("hf_cb", {}).get("tok_s"):
        res["adaspec_over_hf_cb"] = ours / res["hf_cb"]["tok_s"]
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "args"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
