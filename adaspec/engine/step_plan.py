"""The step plan: what the scheduler decided for one step (`StepPlan`, one `ScheduledRequest`
per request, with its draft shape: the one decision, already capped and reserved) and what
the runner returns per request (`StepResult`). Plain data, no behaviour beyond derived counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from adaspec.engine.request import Request
from adaspec.spec_decode.tree import DraftShape


@dataclass
class ScheduledRequest:
    """One request's part of a step. Its target rows are positions start .. start+num_rows-1:
    first `catchup` positions below num_computed (target KV in place, not rewritten: their
    aux features feed the draft refresh), then `num_new_tokens` new ones (a catch-up that
    does not finish this step schedules no new ones). Fields after `draft` are fixed when
    planned: launching the step advances the request's counters."""

    req: Request
    num_new_tokens: int               # committed tokens fed to the target this step
    draft: DraftShape | None = None   # this request's draft budget (None = no speculation)
    refresh: bool | None = None       # write the draft KV of its rows (None: when it drafts)
    catchup: int = 0                  # rows re-run for the draft, from req.draft_valid_len
    # True when the step reaches the end of the sequence, so a token is emitted.
    samples: bool = field(init=False)
    start: int = field(init=False)    # position of its first row
    write_from: int = field(init=False)   # rows at positions below write no target KV

    def __post_init__(self) -> None:
        r = self.req
        self.samples = r.num_computed + self.num_new_tokens == r.num_tokens
        self.start = r.draft_valid_len if self.catchup else r.num_computed
        self.write_from = r.num_computed
        if self.refresh is None:
            self.refresh = self.draft is not None

    @property
    def num_rows(self) -> int:
        return self.catchup + self.num_new_tokens


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    policy_shape: DraftShape | None = None   # what the policy decided for the step
    batch_size: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_rows + (s.draft.num_nodes if s.draft else 0) for s in self.scheduled)

    @property
    def draft_len(self) -> int:
        return max((s.draft.num_nodes for s in self.scheduled if s.draft), default=0)

    @property
    def speculative(self) -> bool:
        """Some request verifies drafts: how many tokens it emits is known only afterwards."""
        return any(s.draft is not None for s in self.scheduled)

    def __str__(self) -> str:
        rows = [f"  {s.req.request_id}: +{s.num_new_tokens} tokens, draft={s.draft or 0}"
                + (f", catch-up {s.catchup}" if s.catchup else "") + ("" if s.refresh else ", no refresh")
                for s in self.scheduled]
        pre = f", preempted {[r.request_id for r in self.preempted]}" if self.preempted else ""
        return f"StepPlan(policy={self.policy_shape or 0}, batch={self.batch_size}{pre})\n" + "\n".join(rows)


@dataclass
class StepResult:
    """Runner output for one scheduled request."""

    emitted: list[int]            # accepted draft tokens + the bonus token ([] mid-prefill)
    num_accepted: int = 0         # accepted draft tokens (their KV is now in place)
    tree_depth: int = 0           # depth of the verified tree (0 = no speculation)
    tree_nodes: int = 0           # draft tokens verified
    path: list[int] = field(default_factory=list)  # accepted tree node indices, root excluded
    discarded: bool = False       # set by postprocess: the request had finished before (overlap)
    logprobs: list | None = None  # per emitted token (logprob, ((id, logprob), ...)) if the request asks
    prompt_logprobs: tuple | None = None   # (first position, [as logprobs] per prompt token predicted)
