"""Start-up profile for the `auto` policy: time real decode steps of synthetic requests at a
few batch sizes and draft depths, so the policy's cost table is not empty at the first
request. It drives the KV manager and the runner directly (no scheduler) and gives every
block back before returning.
"""
from __future__ import annotations

import torch

from adaspec.engine.request import Request, Status
from adaspec.engine.step_plan import ScheduledRequest, StepPlan
from adaspec.sampling import SamplingParams
from adaspec.spec_decode.tree import DraftShape

PROFILE_PROMPT_LEN = 64


def profile_step_times(engine, shapes: list[DraftShape | None], max_batch: int | None = None,
                       repeats: int = 2) -> dict:
    """{(batch size, depth): seconds} for batch sizes 1, 2, 4, ... up to what the scheduler
    and the KV cache allow (and `max_batch`), and "catchup_token": the seconds a row of a
    prompt chunk costs (what a draft catch-up row costs: the target over a missed position),
    from the second run of the first prefill chunk."""
    runner, kv = engine.runner, engine.kv
    spec_slots = max((s.spec_slots for s in shapes if s), default=0)
    # Room for the step's own draft and, with overlap, for a step in flight that may shift it
    # by as many positions again (device.shift).
    per_req = PROFILE_PROMPT_LEN + 2 * (spec_slots + 2)
    # Serving with overlap plans each speculative step while the previous one runs: its token
    # is still on the device and its positions are shifted there. Profiled the same way (the
    # shift is host work a host-bound step pays: measured 3x on the demo pair without it).
    in_flight = engine.config.overlap and runner.draft is not None and runner.draft.num_layers == 1
    limit = min(engine.config.scheduler.max_num_seqs, kv.num_free // kv.blocks_for(per_req),
                max_batch or (256 if runner.device.type == "cuda" else 8))
    if limit < 1:
        return {}
    sizes = []
    b = 1
    while b <= limit:
        sizes.append(b)
        b *= 2
    g = torch.Generator().manual_seed(0)
    vocab = runner.model_spec.vocab_size
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    reqs = []
    try:
        for i in range(sizes[-1]):
            prompt = torch.randint(0, vocab, (PROFILE_PROMPT_LEN,), generator=g).tolist()
            r = Request(f"__profile{i}", prompt, params, set())
            r.status = Status.RUNNING   # owns a device row while profiling
            if not kv.reserve(r, per_req):   # `limit` says it fits; never inside an assert (-O)
                raise RuntimeError(f"profiling could not reserve {per_req} tokens of KV")
            reqs.append(r)
        # Prefill in chunks that respect the step budget, then one "emitted" token: on the host,
        # or (overlap) still on the device, as a step planned before its predecessor was read.
        chunk = max(1, engine.config.scheduler.max_num_batched_tokens // PROFILE_PROMPT_LEN)
        out = {}
        for k in range(0, len(reqs), chunk):
            part = reqs[k:k + chunk]
            plan = StepPlan([ScheduledRequest(r, PROFILE_PROMPT_LEN) for r in part])
            runner.execute(plan)
            if k == 0:   # again, warm: the same KV written again (state is not committed)
                runner.execute(plan)
                out["catchup_token"] = runner.last_step_time / (PROFILE_PROMPT_LEN * len(part))
            for r in part:
                r.num_computed = PROFILE_PROMPT_LEN
                if in_flight:
                    r.pending = 1
                else:
                    r.append_token(int(torch.randint(0, vocab, (1,), generator=g)))
        for b in sizes:
            for depth, shape in enumerate(shapes):
                plan = StepPlan([ScheduledRequest(r, 1, shape) for r in reqs[:b]])
                runner.execute(plan)          # warms caches/kernels; state is not committed,
                # so every launch is the same step. Launched back to back, as the engine runs
                # them with overlap: a step's host work hides behind the previous step, and its
                # time is what serving sees (timed alone, it would include that host work).
                steps = [runner.launch(plan) for _ in range(repeats + 1)]
                times = []
                for st in steps:
                    runner.collect(st)
                    times.append(runner.last_step_time)
                out[(b, depth)] = min(times[1:]) if len(times) > 1 else times[0]
        return out
    finally:
        for r in reqs:
            r.pending = 0
            kv.free_request(r)
            r.status = Status.FINISHED
