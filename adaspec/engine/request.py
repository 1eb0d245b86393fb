"""A request's life inside the engine, and what the engine hands back for it.

Token bookkeeping, the invariant everything else relies on:
  all_token_ids = prompt + generated, length n.
  num_computed  = positions whose target KV is in the cache; between steps it is n - 1
                  (the last emitted token is fed on the next step) except while prefilling.
  The draft head's KV for the pair (hidden_p, token_{p+1}) lives at draft slot p + 1 (see
  spec_decode/drafter.py).
  draft_valid_len = pairs 0..draft_valid_len-1 are in the draft cache (and the request's
                  device draft hidden is that of the last of them). A step refreshes the draft
                  only for requests that may speculate in it; a request that does not falls
                  behind (draft_valid_len < num_computed) and is caught up, from the target's
                  recomputed hidden states, before it drafts again (scheduler.py).

Overlap (CPU work of step N+1 while the GPU runs step N): when a step is launched the
scheduler advances `num_computed` at once, and a request that samples in it owes one token
(`pending`) until the step's results are read back. `num_tokens` and `num_output_tokens`
count pending tokens, so the next step can be planned before the token is known; its id is
filled on the device from the previous step's output (see ModelRunner). A speculative step
may emit up to `spec_ahead` tokens more than that one: the next step reserves KV for it, and
the runner shifts its positions on the device once the count is known there.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from adaspec.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculation figures of one request (or, summed, of the engine)."""

    verify_steps: int = 0          # target steps in which this request verified >= 1 draft token
    draft_tokens: int = 0          # draft tokens proposed for verification
    accepted_tokens: int = 0       # of those, accepted
    emitted_tokens: int = 0        # tokens emitted by verify steps (accepted + bonus)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted_chain: int, num_draft_nodes: int, num_accepted: int) -> None:
        """One verify step: `num_drafted_chain` = depth of the tree (chain length), `num_draft_nodes`
        = tree nodes proposed, `num_accepted` = accepted draft tokens (bonus excluded)."""
        self.verify_steps += 1
        self.draft_tokens += num_draft_nodes
        self.accepted_tokens += num_accepted
        self.emitted_tokens += num_accepted + 1
        for lst, n in ((self.drafted_per_position, num_drafted_chain), (self.accepted_per_position, num_accepted)):
            if len(lst) < num_drafted_chain:
                lst.extend([0] * (num_drafted_chain - len(lst)))
            for i in range(n):
                lst[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.verify_steps += other.verify_steps
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.emitted_tokens += other.emitted_tokens
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def as_dict(self) -> dict:
        rates = [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
        return {
            "verify_steps": self.verify_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accept_length": (self.emitted_tokens / self.verify_steps) if self.verify_steps else 0.0,
            "accept_rate_per_position": rates,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
        }


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step (incremental) or at the end (whole).

    Incremental (from `Engine.step`): `new_token_ids` / `new_text` hold what this step added.
    Whole (from `LLM.generate`): `token_ids` / `text` hold everything generated.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    new_token_ids: list[int]
    new_text: str | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    spec: dict                 # the request's speculation figures (SpecStats.as_dict), final output only
    num_cached_tokens: int = 0
    error: str | None = None
    queue_time: float | None = None  # seconds from arrival to first scheduled (set once scheduled)
    # SamplingParams.logprobs: per generated token (logprob, ((token id, logprob),) * k), raw
    # target log-probabilities; `new_logprobs` for `new_token_ids`, `logprobs` for `token_ids`.
    logprobs: list | None = None
    new_logprobs: list | None = None
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, else as above.
    prompt_logprobs: list | None = None
    # What stopped it (finish_reason "stop"): the stop string, the stop_token_ids id, or None
    # for EOS and a completed grammar (vLLM's `stop_reason`).
    stop_reason: int | str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def outputs(self) -> list["CompletionOutput"]:
        """vLLM's view of the same output (`out.outputs[0].text`): one completion. (A prompt
        with n > 1 gives n RequestOutputs here, each with its one completion.)"""
        lps = self.logprobs
        return [CompletionOutput(0, self.text or "", list(self.token_ids),
                                 sum(e[0] for e in lps) if lps is not None else None, lps,
                                 self.finish_reason, self.stop_reason)]


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's CompletionOutput fields, for code written against vLLM's offline API."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None   # the sum of the tokens' (raw) logprobs, when asked for
    logprobs: list | None
    finish_reason: str | None
    stop_reason: int | str | None


class Request:
    """Engine-side state of one request. Mutated by the scheduler and the detokenizer, and by
    the runner's `DeviceRows` for its device row (`row`, `table_synced`). `seed` keys the
    request's counter-based sampling noise (`sampling.choose`): the user's seed, or a random
    one drawn when the request arrived."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], arrival: float | None = None, seed: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_ids: list[int] = []   # all_token_ids past the prompt, kept as its own list (append_token)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first_scheduled: float | None = None   # when it first left the waiting queue
        self.seed = seed
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_ids: list[int] = []
        self.num_cached_tokens = 0      # prompt tokens served by the prefix cache (last admission)
        self.draft_valid_len = 0        # leading pairs (hidden_p, token_{p+1}) in the draft cache
        self.num_hashed_blocks = 0      # leading blocks registered in the prefix cache
        self.num_draft_blocks = 0       # ... of those, flagged as holding complete draft KV
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.spec_stats = SpecStats()
        self.sim_key: int | None = None   # simulated acceptance (benchmarks): spec_decode.simulated
        self.sim_steps = 0
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = ([None] * len(prompt_token_ids) if params.prompt_logprobs is not None
                                             else None)
        self.row = -1                   # row of the runner's persistent device state (-1: none)
        self.table_synced = 0           # leading block_ids the device block table already holds
        self.num_preemptions = 0
        self.pending = 0                # tokens emitted by a launched step, not yet read back
        self.in_flight = 0              # planned steps whose results are not yet applied
        self.spec_ahead = 0             # extra tokens a launched, unread speculative step may emit
        self.grammar = None             # structured.grammar.RequestGrammar of a constrained output
        self.bad_word_ids: list[tuple[int, ...]] = []   # SamplingParams.bad_words, tokenized
        self.stop_reason: int | str | None = None       # the stop id or string that ended it
        # detokenizer state
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.decode_stream = None       # the detokenizer's DecodeStream (fast tokenizers)
        self.stop_checked_len = 0
        self.num_emitted_reported = 0
        self.text_reported = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens read back so far: the request's own list, not a copy (read it,
        copy what you keep). A slice of all_token_ids cost O(output) per call, several calls
        per request per step."""
        return self.output_ids

    def append_token(self, tok: int) -> None:
        """A generated token read back (the only way tokens join a request)."""
        self.all_token_ids.append(tok)
        self.output_ids.append(tok)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) + self.pending - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, n={self.num_tokens}, computed={self.num_computed}, "
                f"draft_valid={self.draft_valid_len}, "
                f"blocks={len(self.block_ids)}, {self.status.value})")
