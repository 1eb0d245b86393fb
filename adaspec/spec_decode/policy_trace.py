"""A record of what a speculation policy observed, step by step, for replaying served noise and
acceptance offline (benchmarks/auto_sim.py --noise-from): the engine process keeps one when
ADASPEC_POLICY_TRACE=PREFIX is set and writes PREFIX.<pid>.jsonl at a clean stop.

The file's first line describes the policy ({"policy", "num_steps", "topk"}); each further line
is one observed step: [batch size, draft length, cost in us (StepFeedback.step_time), prompt or
catch-up rows, accepted per position, drafted per position, probe, query rows], `probe` true
where an `auto` probe ran the step (false for every other policy), `query rows` the target
forward's (StepFeedback.num_tokens; files written before session 22 end at `probe`).
"""
from __future__ import annotations

import json

from adaspec.spec_decode.policy_base import SpeculationPolicy, StepFeedback


class PolicyTrace:
    """Wraps `policy.observe` so that each step it is fed is also recorded (in memory: a few
    dozen bytes a step; `write` puts them in a file)."""

    def __init__(self, policy: SpeculationPolicy):
        self.policy = policy
        self.records: list[list] = []
        self._observe = policy.observe
        policy.observe = self._traced

    def _traced(self, fb: StepFeedback) -> None:
        self._observe(fb)
        self.records.append([fb.batch_size, fb.draft_len, round(fb.step_time * 1e6, 1), fb.num_prefill_tokens,
                             list(fb.accepted_per_position), list(fb.drafted_per_position), self.policy.last_was_probe,
                             fb.num_tokens])

    def write(self, path: str) -> None:
        cfg = self.policy.cfg
        with open(path, "w") as f:
            f.write(json.dumps({"policy": self.policy.name, "num_steps": cfg.num_steps, "topk": cfg.topk}) + "\n")
            for r in self.records:
                f.write(json.dumps(r) + "\n")
