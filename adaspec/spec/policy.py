"""THE speculation decision point.

Once per step, before any KV slot is reserved, the scheduler calls
`policy.decide(batch_size)` and gets the draft shape for the step (None = no speculation).
The scheduler then applies per-request caps (opt-out, `max_draft_tokens`, tokens left) and
reserves exactly what the resulting plan says. After the step the engine reports what
happened through `policy.observe(feedback)`, which is how `auto` learns.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

from adaspec.config import SpecConfig
from adaspec.spec.tree import DraftShape


@dataclass(frozen=True)
class StepFeedback:
    """What one executed step looked like, for policies that learn."""

    batch_size: int                 # requests that ran this step
    num_tokens: int                 # query tokens in the target forward
    draft_len: int                  # draft tokens per speculating request (0 = none)
    step_time: float                # seconds, whole step (draft + target + sampling)
    num_prefill_tokens: int = 0     # > 0: the step also prefetched prompts (timing less clean)
    accepted_per_position: tuple = field(default_factory=tuple)  # this step's counts
    drafted_per_position: tuple = field(default_factory=tuple)


class SpeculationPolicy(abc.ABC):
    """Base: subclasses implement `decide`. `shapes` are the candidates, shortest first."""

    name = "base"

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.configured = self.configured_shape(cfg)
        self.last: DraftShape | None = None

    @staticmethod
    def configured_shape(cfg: SpecConfig) -> DraftShape:
        return DraftShape(cfg.num_steps, cfg.topk, cfg.resolved_num_draft_tokens)

    @abc.abstractmethod
    def decide(self, batch_size: int) -> DraftShape | None:
        """The step's draft shape for a batch of `batch_size` running requests (None: don't)."""

    def observe(self, fb: StepFeedback) -> None:
        """Default: nothing to learn."""

    def describe(self) -> dict:
        return {"policy": self.name, "shape": str(self.configured)}


class OffPolicy(SpeculationPolicy):
    name = "off"

    def decide(self, batch_size: int) -> DraftShape | None:
        return None


class AlwaysPolicy(SpeculationPolicy):
    name = "always"

    def decide(self, batch_size: int) -> DraftShape | None:
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

    def decide(self, batch_size: int) -> DraftShape | None:
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
}


def make_policy(cfg: SpecConfig) -> SpeculationPolicy:
    return POLICIES[cfg.policy](cfg)
