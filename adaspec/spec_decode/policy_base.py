"""What every speculation policy is (`SpeculationPolicy`) and what it learns from
(`StepFeedback`): the contract spec_decode/policy.py's registry and the scheduler rely on."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

from adaspec.config import SpecConfig
from adaspec.spec_decode.tree import DraftShape



@dataclass(frozen=True)
class StepFeedback:
    """What one executed step looked like, for policies that learn."""

    batch_size: int                 # requests that ran this step
    num_tokens: int                 # query tokens in the target forward
    draft_len: int                  # draft tokens per speculating request (0 = none)
    step_time: float                # seconds the step cost the engine's cadence: its device span, or
                                    # the host's work per cycle where larger (engine/step_clock.py)
    num_prefill_tokens: int = 0     # > 0: the step also prefetched prompts (timing less clean)
    accepted_per_position: tuple = field(default_factory=tuple)  # this step's counts
    drafted_per_position: tuple = field(default_factory=tuple)


class SpeculationPolicy(abc.ABC):
    """Base: subclasses implement `decide`. `shapes` are the candidates, shortest first."""

    name = "base"
    prices_catchup = False   # True: `decide` wants `catchup_tokens` (the scheduler counts them)
    refreshes_prompts = True  # prompt rows write the draft KV even in steps that do not speculate
    last_was_probe = False    # the step `observe` was last fed was a probe (`auto`: a short run of another depth)

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.configured = self.configured_shape(cfg)
        self.last: DraftShape | None = None

    @staticmethod
    def configured_shape(cfg: SpecConfig) -> DraftShape:
        return DraftShape(cfg.num_steps, cfg.topk, cfg.resolved_num_draft_tokens)

    @abc.abstractmethod
    def decide(self, batch_size: int, catchup_tokens: int = 0) -> DraftShape | None:
        """The step's draft shape for a batch of `batch_size` running requests (None: don't).
        `catchup_tokens`: draft positions to catch up on before speculating (only given to
        policies with `prices_catchup`)."""

    def observe(self, fb: StepFeedback) -> None:
        """Default: nothing to learn."""

    def keeps_draft_fresh(self, batch_size: int) -> bool:
        """Whether decode rows refresh the draft in a step this policy said 0 for (so that
        speculating again owes no catch-up). Default: no, speculation off costs nothing."""
        return False

    def describe(self) -> dict:
        return {"policy": self.name, "shape": str(self.configured)}
