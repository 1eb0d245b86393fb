#!/usr/bin/env python3
"""`auto` against fixed draft lengths in a closed loop on a simulated device: the real
`Engine.step` (scheduler, prefill pacer, the speculation policies, the start-up profile) with
a runner that runs no model (tests/engine/fake_runner.py), acceptance as
`--spec-simulate-accept-rate` gives it (each draft token accepted with probability p while
the ones before it were), and a virtual clock advanced by a step cost model:

    step ms = T(batch, depth) + (fixed + per_token * prompt rows, if the step has prompt rows)

    python3 benchmarks/policy_sim.py --concurrency 1,2,4,8,16,32,64,128,256 \
        --configs off,chain3,chain4,auto [--prefill-fixed-ms 58.4] [--json out.json]
    python3 benchmarks/policy_sim.py --costs-from SERVER_LOG     # an `auto` server's shutdown figures

T: a measured table of decode and verify steps by draft depth and batch; the default is what
session 18's served `auto` measured on the H200 for the Qwen3-30B-A3B shape (its shutdown
`step_ms`, benchmarks/results/h200/moe/load_experiment_8w/part-e/server-auto.log), and prompt
rows cost what that run fitted (58.4 ms fixed, 6.7 us per token: eager prompt steps).
`--costs-from LOG` takes both from another `auto` server's log (its "engine stats at shutdown"
line: `step_ms`, `catchup_fixed_us`, `catchup_token_us`). Every
configuration sees the same costs, so what differs is the policy alone: the question this
answers is whether `auto`, fed those costs, picks what the best fixed length would have made.
Requests: 512 prompt tokens, 256 output, each client sending its next request up to
`--jitter-ms` after its last ended; a fresh engine per level and configuration. Simulation,
not a measurement of the device.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engine"), str(ROOT / "benchmarks")]

from fake_runner import FakeRunner  # noqa: E402
from pacer_sim import closed_loop, decode_ms  # noqa: E402

from adaspec.config import EngineConfig  # noqa: E402
from adaspec.engine.engine import Engine  # noqa: E402
from adaspec.engine.step_plan import StepResult  # noqa: E402

# session 18, served auto's step_ms at shutdown, every entry: {depth: {batch: ms}}
MOE_STEP_MS = {
    0: {1: 2.84, 2: 6.397, 4: 5.29, 8: 7.884, 16: 11.924, 32: 15.017, 64: 16.585, 128: 17.428, 256: 18.56},
    1: {1: 3.622, 2: 4.9, 4: 6.961, 8: 9.553, 16: 12.732, 32: 15.861, 64: 17.332, 128: 18.47, 256: 21.196},
    2: {1: 4.254, 2: 5.595, 3: 7.423, 4: 7.382, 8: 9.754, 16: 13.12, 32: 16.612, 64: 17.936, 128: 22.36, 256: 29.288},
    3: {1: 4.562, 2: 6.426, 4: 7.803, 6: 9.894, 8: 10.427, 16: 13.748, 32: 17.632, 64: 19.799, 96: 28.501,
        128: 23.313, 192: 29.872, 256: 31.877},
    4: {1: 5.583, 2: 6.357, 3: 7.871, 4: 7.96, 6: 10.42, 8: 10.934, 12: 13.812, 16: 14.64, 24: 17.732,
        32: 18.206, 48: 20.759, 64: 21.589, 96: 24.638, 128: 26.048, 192: 31.705, 256: 47.057},
}
CONFIGS = {   # name -> engine keywords (a draft head is simulated for all but off)
    "off": {},
    "chain3": dict(speculation="always", num_steps=3, topk=1),
    "chain4": dict(speculation="always", num_steps=4, topk=1),
    "auto": dict(speculation="auto", num_steps=4, topk=1),
}


class SimRunner(FakeRunner):
    """FakeRunner with geometric acceptance and `execute` (the start-up profile's)."""

    def __init__(self, accept: float, rng: random.Random, draft: bool, on_launch):
        super().__init__(60000, rng, draft, on_launch)
        self.accept = accept

    def execute(self, plan):
        return self.collect(self.launch(plan))

    def collect(self, step):
        if self.inflight is step.plan:
            self.inflight = None
        if step.cost is not None:
            self.last_step_time = step.cost
        out = []
        for s in step.plan.scheduled:
            if not s.samples:
                out.append(StepResult(emitted=[]))
                continue
            depth = s.draft.num_steps if s.draft is not None else 0
            acc = 0
            while acc < depth and self.rng.random() < self.accept:
                acc += 1
            out.append(StepResult(emitted=[self.rng.randrange(3, 50) for _ in range(acc + 1)], num_accepted=acc,
                                  tree_depth=depth, tree_nodes=depth, path=list(range(1, acc + 1))))
        return out


def costs_from_log(path: str) -> tuple[dict, float, float]:
    """(step ms by depth and batch, prompt fixed ms, prompt ms per token) from the last "engine
    stats at shutdown" line of an `auto` server's log."""
    import ast

    line = [x for x in Path(path).read_text().splitlines() if "engine stats at shutdown:" in x][-1]
    state = ast.literal_eval(line.split("engine stats at shutdown:", 1)[1].strip())["policy_state"]
    table = {int(d): {int(b): float(ms) for b, ms in row.items()} for d, row in state["step_ms"].items()}
    return table, state["catchup_fixed_us"] / 1e3, state["catchup_token_us"] / 1e3


def run(config: str, concurrency: int, waves: int, accept: float, fixed_ms: float, per_token_ms: float,
        jitter_ms: float, seed: int = 0, table: dict | None = None) -> dict:
    clock = [0.0]
    depths: dict[int, int] = {}
    acc = dict.fromkeys(("prompt_steps", "prompt_s", "decode_steps", "decode_s", "decode_rows"), 0)

    def on_launch(plan, _inflight):
        decoders = [s for s in plan.scheduled if s.num_new_tokens <= 1]
        depth = max((s.draft.num_steps for s in plan.scheduled if s.draft is not None), default=0)
        prefill = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
        ms = decode_ms((table or MOE_STEP_MS)[depth], max(1, len(decoders))) if decoders or not prefill else 0.0
        ms += fixed_ms + per_token_ms * prefill if prefill else 0.0
        depths[depth] = depths.get(depth, 0) + 1
        kind = "prompt" if prefill else "decode"
        acc[f"{kind}_steps"] += 1
        acc[f"{kind}_s"] += ms / 1e3
        acc["decode_rows"] += len(decoders) if not prefill else 0
        clock[0] += ms / 1e3
        return ms / 1e3   # this step's time when it is collected (with overlap, after the next launch)

    kw = CONFIGS[config]
    runner = SimRunner(accept, random.Random(seed), bool(kw), on_launch)
    runner.model_spec.max_position = 4096
    runner.model_spec.vocab_size = 50
    cfg = EngineConfig.create("fake-model", max_num_seqs=256, max_num_batched_tokens=8192, block_size=16,
                              num_blocks=60000, **(dict(draft="fake-head") if kw else {}), **kw)
    eng = Engine(cfg, runner=runner)
    total = concurrency * waves
    closed_loop(eng, clock, concurrency, waves, jitter_ms, seed + 1,
                after_warm_up=lambda: (depths.clear(), acc.update(dict.fromkeys(acc, 0))))
    return {"config": config, "concurrency": concurrency, "tok_per_s": round(total * 256 / clock[0], 1),
            "steps_by_depth": dict(sorted(depths.items())), "prompt_steps": acc["prompt_steps"],
            "prompt_share": round(acc["prompt_s"] / clock[0], 3), "decode_steps": acc["decode_steps"],
            "decode_batch_mean": round(acc["decode_rows"] / max(1, acc["decode_steps"]), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--configs", default="off,chain3,chain4,auto")
    p.add_argument("--waves", type=int, default=8)
    p.add_argument("--accept-rate", type=float, default=0.8)
    p.add_argument("--prefill-fixed-ms", type=float, default=58.4)
    p.add_argument("--prefill-token-ms", type=float, default=0.0067)
    p.add_argument("--jitter-ms", type=float, default=10.0)
    p.add_argument("--costs-from", default=None, help="an auto server's log: its shutdown cost table and prompt fit")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    table = None
    if a.costs_from:
        table, a.prefill_fixed_ms, a.prefill_token_ms = costs_from_log(a.costs_from)
        print(json.dumps({"costs_from": a.costs_from, "prefill_fixed_ms": a.prefill_fixed_ms,
                          "prefill_token_ms": a.prefill_token_ms}))
    rows = []
    for c in a.concurrency.split(","):
        level = {cfg: run(cfg, int(c), a.waves, a.accept_rate, a.prefill_fixed_ms, a.prefill_token_ms, a.jitter_ms,
                          table=table) for cfg in a.configs.split(",")}
        fixed = {k: v["tok_per_s"] for k, v in level.items() if k != "auto"}
        best = max(fixed, key=fixed.get)
        row = {"concurrency": int(c), **{k: v["tok_per_s"] for k, v in level.items()}, "best_fixed": best}
        if "auto" in level:
            row["auto_over_best"] = round(level["auto"]["tok_per_s"] / fixed[best], 3)
            row["auto_depths"] = level["auto"]["steps_by_depth"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
