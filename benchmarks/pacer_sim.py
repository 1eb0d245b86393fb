#!/usr/bin/env python3
"""The prefill pacer in a closed loop on a simulated device: the real `Engine.step` with a
runner that runs no model (tests/engine/fake_runner.py) and a virtual clock advanced by a step
cost model, so what pacing does to TTFT, TPOT and throughput is seen without a GPU.

    python3 benchmarks/pacer_sim.py --shape moe --concurrency 1,2,4,8,16,64 [--per-token-only]

Cost models (ms; speculation off): `moe` is the Qwen3-30B-A3B shape on the H200, decode from
session 18's served `auto` cost table (2.8 ms at batch 1, 5.3 at 4, 11.9 at 16, 16.6 at 64, 18.6
at 256), prefill a fixed 10 ms (assumed: the experts a chunk reads; `--prefill-fixed-ms 60` is
what that run's `auto` fitted, eager launches included) plus 0.01 ms per token (assumed: 3B
active parameters at ~600 TFLOP/s); `dense` is the 8B shape, decode 5.3-15.8 ms, prefill 1 ms
fixed plus 0.023 ms per token (assumed). `--per-token-only` prices prefill per token alone, as
the pacer did before session 18.

Requests: 512 prompt tokens, 256 output. A client sends its next request up to `--jitter-ms`
after its last ends (its round trip), so answers that started together do not arrive back
together. Each level runs on a fresh engine, after two warm-up requests (as `adaspec compare`
sends them).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engine")]

from fake_runner import FakeRunner  # noqa: E402

from adaspec.config import EngineConfig  # noqa: E402
from adaspec.engine.engine import Engine  # noqa: E402
from adaspec.sampling import SamplingParams  # noqa: E402

SHAPES = {   # (decode ms by batch, prefill fixed ms, prefill ms per token)
    "moe": ({1: 2.8, 4: 5.3, 16: 11.9, 64: 16.6, 256: 18.6}, 10.0, 0.01),
    "dense": ({1: 5.3, 16: 5.9, 64: 8.6, 256: 15.8}, 1.0, 0.023),
}


def decode_ms(table: dict, b: int) -> float:
    pts = sorted(table.items())
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if b <= b1:
            return t0 + (t1 - t0) * (max(b, b0) - b0) / (b1 - b0)
    return pts[-1][1]


def closed_loop(eng: Engine, clock: list, concurrency: int, waves: int, jitter_ms: float, seed: int = 1,
                after_warm_up=None) -> tuple[dict, dict, dict]:
    """Serve `concurrency` clients `waves` requests each (512 prompt tokens, 256 output) on
    `eng`, whose runner advances `clock[0]` (seconds); a client sends its next request 0 to
    `jitter_ms` after its last ended. Two warm-up requests run first (as `adaspec compare` sends
    before a level), then the clock restarts and `after_warm_up()` is called. Returns (arrival,
    first token, finish) times by request id."""
    sp = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    total = concurrency * waves
    rng = random.Random(seed)
    for k in range(2):
        eng.add_request(f"w{k}", [rng.randrange(3, 50) for _ in range(512)], sp)
    while eng.has_unfinished():
        eng.step()
    clock[0] = 0.0
    if after_warm_up is not None:
        after_warm_up()
    arrive, first, done, sent = {}, {}, {}, 0
    due: list[float] = [rng.uniform(0, jitter_ms) / 1e3 for _ in range(concurrency)]   # next sends
    while len(done) < total:
        for t in sorted(due):
            if t <= clock[0] and sent < total:
                due.remove(t)
                rid = f"r{sent}"
                eng.add_request(rid, [rng.randrange(3, 50) for _ in range(512)], sp)
                arrive[rid] = t
                sent += 1
        if not eng.has_unfinished():   # idle until the next client sends
            clock[0] = min(due)
            continue
        for out in eng.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = clock[0]
            if out.finished:
                done[out.request_id] = clock[0]
                due.append(clock[0] + rng.uniform(0, jitter_ms) / 1e3)   # the client's round trip
    return arrive, first, done


def run(shape: str, concurrency: int, waves: int, per_token_only: bool, jitter_ms: float,
        fixed_ms: float | None = None) -> dict:
    table, fixed, per = SHAPES[shape]
    fixed = fixed if fixed_ms is None else fixed_ms
    clock = [0.0]

    def on_launch(plan, _inflight):
        b = len(plan.scheduled)
        prefill = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
        ms = decode_ms(table, b) + (fixed + per * prefill if prefill else 0.0)
        clock[0] += ms / 1e3
        return ms / 1e3   # this step's time when it is collected (with overlap, after the next launch)

    runner = FakeRunner(60000, random.Random(0), False, on_launch)
    runner.model_spec.max_position = 4096
    runner.model_spec.vocab_size = 50
    cfg = EngineConfig.create("fake-model", max_num_seqs=256, max_num_batched_tokens=8192, block_size=16,
                              num_blocks=60000)
    eng = Engine(cfg, runner=runner)
    arrive, first, done = closed_loop(eng, clock, concurrency, waves, jitter_ms)
    total = concurrency * waves
    ttft = sorted(first[r] - arrive[r] for r in done)
    tpot = sorted((done[r] - first[r]) / 255 for r in done)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return {"shape": shape, "concurrency": concurrency, "per_token_only": per_token_only, "prefill_fixed_ms": fixed,
            "tok_per_s": round(total * 256 / clock[0], 1), "ttft_p50_ms": round(q(ttft, 0.5) * 1e3, 1),
            "ttft_p99_ms": round(q(ttft, 0.99) * 1e3, 1), "tpot_p50_ms": round(q(tpot, 0.5) * 1e3, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="moe")
    p.add_argument("--concurrency", default="1,2,4,8,16,64")
    p.add_argument("--waves", type=int, default=8)
    p.add_argument("--per-token-only", action="store_true")
    p.add_argument("--jitter-ms", type=float, default=10.0,
                   help="a client sends its next request 0..this many ms after its last one ends")
    p.add_argument("--prefill-fixed-ms", type=float, default=None, help="the shape's fixed prefill cost instead")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.per_token_only:   # the pacer before session 18 priced an EMA of seconds / token: here their median
        import adaspec.engine.prefill_pacer as pp
        pp.fixed_and_per_row = lambda s: (0.0, sorted(t / n for n, t in s)[len(s) // 2]) if s else (0.0, 0.0)
    rows = [run(a.shape, int(c), a.waves, a.per_token_only, a.jitter_ms, a.prefill_fixed_ms) for c in a.concurrency.split(",")]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
