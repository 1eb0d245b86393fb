"""THE speculation decision point.

Once per step, before any KV slot is reserved, the scheduler calls
`policy.decide(batch_size)` and gets the draft shape for the step (None = no speculation).
A policy with `prices_catchup` is also told how many positions the draft would have to catch
up on to speculate now (`catchup_tokens`: requests that did not speculate got no draft
refresh, see engine/scheduler.py), the price of resuming.
The scheduler then applies per-request caps (`tree.request_shape`: opt-out, `max_draft_tokens`,
tokens left) and reserves exactly what the resulting plan says. After the step the engine reports what
happened through `policy.observe(feedback)`, which is how `auto` learns.
"""
from __future__ import annotations

from adaspec.config import SpecConfig
from adaspec.spec_decode.auto_policy import AutoPolicy
from adaspec.spec_decode.policy_base import SpeculationPolicy, StepFeedback
from adaspec.spec_decode.tree import DraftShape

__all__ = ["POLICIES", "AlwaysPolicy", "AutoPolicy", "OffPolicy", "SpeculationPolicy", "StepFeedback",
           "ThresholdPolicy", "make_policy"]


class OffPolicy(SpeculationPolicy):
    name = "off"
    refreshes_prompts = False   # it never speculates: nothing of the draft runs

    def decide(self, batch_size: int, catchup_tokens: int = 0) -> DraftShape | None:
        return None


class AlwaysPolicy(SpeculationPolicy):
    name = "always"

    def decide(self, batch_size: int, catchup_tokens: int = 0) -> DraftShape | None:
        return self.configured


class ThresholdPolicy(SpeculationPolicy):
    """Speculate while at most N requests run; once off, stay off until the batch drops to
    N - hysteresis, so a batch hovering at the boundary does not flap every step."""

    name = "threshold"

    def __init__(self, cfg: SpecConfig):
        super().__init__(cfg)
        self.limit = cfg.spec_disable_batch_size
        h = cfg.hysteresis if cfg.hysteresis is not None else max(1, self.limit // 4)
        self.resume_at = max(0, self.limit - h)
        self.on = True

    def decide(self, batch_size: int, catchup_tokens: int = 0) -> DraftShape | None:
        if self.on and batch_size > self.limit:
            self.on = False
        elif not self.on and batch_size <= self.resume_at:
            self.on = True
        return self.configured if self.on else None

    def describe(self) -> dict:
        return {**super().describe(), "disable_above": self.limit, "resume_at_or_below": self.resume_at}


POLICIES: dict[str, type[SpeculationPolicy]] = {
    "off": OffPolicy,
    "always": AlwaysPolicy,
    "threshold": ThresholdPolicy,
    "auto": AutoPolicy,
}


def make_policy(cfg: SpecConfig) -> SpeculationPolicy:
    return POLICIES[cfg.policy](cfg)
