"""Sampling: what a user asks for (`SamplingParams`), the law it defines (`process_logits`) and
the draws (`choose`). Pure functions of (logits, parameters, seeds, positions): no engine
state, no generator objects.

The draws are counter-based: the noise that picks the token at position p of a request is a
hash of (the request's seed, p, token id), turned into Exp(1) noise for the exponential race
(argmax_x p(x) / E_x, an exact sample of p). So a seeded request draws the same token at the
same position whatever shares its batch, however the step is laid out, and whether the token
is drawn by a plain decode step or checked against a draft at depth d of a verify step:
speculation, its draft length, batching and overlap do not change seeded output. (An EAGLE
draft is deterministic, so accepting the draft child equal to the target's draw is exactly
rejection sampling with a one-hot proposal: lossless, see `spec_decode.verifier`.) Requests
without a seed get a random one when they arrive.

Order of the transforms (vLLM's): the history-dependent processors of `adaspec.penalties`
(logit_bias, min_tokens, repetition / frequency / presence penalties) on the raw logits, then
temperature, min-p, top-k, top-p. Reported logprobs are the RAW model's (vLLM's default
`logprobs_mode=raw_logprobs`): log_softmax of the target's logits before any of these.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from adaspec.structured.spec import StructuredOutput

# Below this temperature a request is greedy (as vLLM treats it): dividing by a tinier one
# overflows float32 and turns the distribution into NaNs.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20   # alternatives per token (OpenAI's limit, vLLM's default max_logprobs)
MAX_N = 64          # choices per prompt


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """Per-request generation controls (OpenAI / vLLM meaning).

    temperature 0 (or below 1e-5) means greedy. top_k <= 0 (or -1) disables top-k; top_p 1.0
    and min_p 0.0 disable those filters. `seed` makes a request's sampling reproducible
    regardless of what else is in the batch and of speculation. `speculate=False` opts the
    request out of speculation; `max_draft_tokens` caps its draft budget. `structured`
    constrains the output to a grammar (JSON, a JSON Schema, a regex, ...: adaspec/structured;
    not with `min_tokens`, which could mask the grammar's only legal token, its end).

    History-dependent (vLLM's semantics, `adaspec.penalties`): `presence_penalty` and
    `frequency_penalty` (in [-2, 2]) count the output tokens, `repetition_penalty` (> 0, 1 =
    off) the prompt and output tokens; `logit_bias` {token id: bias in [-100, 100]} is added
    to the logits; `min_tokens` masks EOS and `stop_token_ids` (and suspends stop strings)
    until that many tokens were generated. `logprobs` = k asks for the log-probability of
    every generated token and the k most likely alternatives (0: the token's own only);
    `prompt_logprobs` the same for every prompt token (the request then skips the prefix
    cache, whose blocks have no logits). `n` choices of one prompt: `choices()` gives their
    per-choice params (seed + index).

    Output and prompt handling (vLLM's fields): `include_stop_str_in_output` keeps the stop
    string (or the stop token's text) at the end of the text; `skip_special_tokens` (default
    on) leaves special tokens out of the text, `spaces_between_special_tokens` (slow
    tokenizers only, as in transformers) spaces them when they are kept;
    `truncate_prompt_tokens` = k keeps the prompt's last k tokens (-1: as many as the context
    holds, leaving room for one output token). `allowed_token_ids` restricts every draw to
    those ids; `bad_words` bans each word (as the model writes it, with and without a leading
    space) at the position where the rest of its tokens would complete it. Both hold on every
    verified draft position too: a draft position sees the draft tokens before it.
    `cache_salt`: only requests with the same salt share prefix-cache blocks. `detokenize`
    False leaves the text out (token ids only, no host time spent on text; not with `stop`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    speculate: bool = True
    max_draft_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    structured: StructuredOutput | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words) if self.bad_words else None
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        t = self.temperature   # (NaN or inf would turn the masked logits' -inf into NaN probabilities)
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < -1):
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_draft_tokens is not None and self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0.0 < rp <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {rp!r}")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {t!r}")
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (the context's limit) or an integer >= 1, got {t!r}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not ids or any(not _is_int(i) or i < 0 for i in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (non-negative integers), "
                                 f"got {ids!r}")
        if not self.detokenize and self.stop:
            raise ValueError("detokenize=False cannot be combined with stop strings (they are found in the text)")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")
        if self.structured is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with a structured output: the grammar decides where "
                             "the output ends, and masking its end token could leave no legal token")

    @property
    def penalized(self) -> bool:
        """The request's logits depend on its history (`adaspec.penalties`)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or self.min_tokens > 0 or self.allowed_token_ids is not None
                or bool(self.bad_words))

    def choices(self) -> list["SamplingParams"]:
        """The params of each of the `n` choices: n = 1 each, seeded seed + index (unseeded
        choices stay unseeded: each gets its own random seed)."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


def random_seed(rng: np.random.Generator) -> int:
    """A seed for a request that did not bring one (from the engine's own stream)."""
    return int(rng.integers(0, 2**62))


# ---- the law -------------------------------------------------------------------------------
@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors (rows = the logits rows they apply to),
    with host flags that skip the filters nobody in the batch uses."""

    temperature: torch.Tensor   # [R] float32 (1.0 on greedy rows)
    min_p: torch.Tensor         # [R] float32
    top_k: torch.Tensor         # [R] int64 (<= 0: disabled)
    top_p: torch.Tensor         # [R] float32
    seed: torch.Tensor          # [R] int64
    greedy: torch.Tensor        # [R] bool
    use_min_p: bool = False
    use_top_k: bool = False
    use_top_p: bool = False

    # Each field's device dtype (and, through numpy, its host one).
    FIELD_DTYPES = {"temperature": torch.float32, "min_p": torch.float32, "top_k": torch.int64,
                    "top_p": torch.float32, "seed": torch.int64, "greedy": torch.uint8}

    @classmethod
    def host_arrays(cls, params: list[SamplingParams], seeds: list[int]) -> dict:
        """The batch's fields as numpy arrays (to stage in the step's one host->device copy)."""
        values = {"temperature": [1.0 if p.greedy else p.temperature for p in params],
                  "min_p": [p.min_p for p in params], "top_k": [p.top_k for p in params],
                  "top_p": [p.top_p for p in params], "seed": seeds, "greedy": [p.greedy for p in params]}
        return {k: torch.tensor(v, dtype=cls.FIELD_DTYPES[k]).numpy() for k, v in values.items()}

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list[int], device: torch.device,
           tensors: dict | None = None) -> "SamplingBatch":
        """From the requests' params; `tensors` = the host arrays already on the device
        (staged), else they are copied here."""
        if tensors is None:
            tensors = {k: torch.as_tensor(v).to(device) for k, v in cls.host_arrays(params, seeds).items()}
        sampled = [p for p in params if not p.greedy]
        return cls(tensors["temperature"], tensors["min_p"], tensors["top_k"], tensors["top_p"], tensors["seed"],
                   tensors["greedy"].bool(), use_min_p=any(p.min_p > 0 for p in sampled),
                   use_top_k=any(p.top_k > 0 for p in sampled), use_top_p=any(p.top_p < 1 for p in sampled))

    def repeat(self, n: int) -> "SamplingBatch":
        """Each row repeated n times (one per verified node)."""
        r = lambda t: t.repeat_interleave(n)   # noqa: E731
        return SamplingBatch(r(self.temperature), r(self.min_p), r(self.top_k), r(self.top_p), r(self.seed),
                             r(self.greedy), self.use_min_p, self.use_top_k, self.use_top_p)


def process_logits(logits: torch.Tensor, params: SamplingBatch | list[SamplingParams]) -> torch.Tensor:
    """Probabilities [R, V] after temperature, min-p, top-k and top-p (vLLM's order).
    Greedy rows become one-hot on the argmax so callers can treat every row alike. Pure."""
    if not isinstance(params, SamplingBatch):
        params = SamplingBatch.of(params, [0] * len(params), logits.device)
    logits = logits.float()
    vocab = logits.shape[-1]
    logits = logits / params.temperature.unsqueeze(1)
    probs = torch.softmax(logits, dim=-1)
    if params.use_min_p:
        thresh = probs.max(dim=-1, keepdim=True).values * params.min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < thresh, 0.0)
    if params.use_top_k:
        k = torch.where(params.top_k > 0, params.top_k, vocab).clamp(max=vocab)
        kth = probs.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.use_top_p:
        probs = probs / probs.sum(dim=-1, keepdim=True)
        sorted_probs, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_probs.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        remove_sorted = (cum - sorted_probs) >= params.top_p.unsqueeze(1)
        probs = probs.masked_fill(torch.zeros_like(remove_sorted).scatter(1, idx, remove_sorted), 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(params.greedy.unsqueeze(1), onehot, probs)


# ---- the draws -----------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values < 2**32. Products may
    wrap in int64; their low 32 bits are exact either way, and those are all that is kept."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def exponential_noise(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [R, vocab], a pure function of (seed [R], position [R], token id)."""
    seed = seed.long()
    base = _mix32(_mix32((seed & _M32) ^ 0x9E3779B9) ^ ((seed >> 32) & _M32))
    base = _mix32(base ^ (position.long() & _M32))
    ids = torch.arange(vocab, device=seed.device, dtype=torch.long)
    h = _mix32(base.unsqueeze(1) ^ _mix32(ids + 0x632BE5AB).unsqueeze(0))
    # 24 bits: every value is exact in float32; u in (0, 1), never 0 or 1.
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


def choose(logits: torch.Tensor, params: SamplingBatch | None, positions: torch.Tensor | None) -> torch.Tensor:
    """The target's token at each row [R]: the argmax for greedy rows (all rows when `params`
    is None), otherwise an exact sample of the row's law drawn with the counter-based noise of
    (its seed, `positions` = the position of the token being drawn)."""
    greedy = logits.argmax(dim=-1)
    if params is None:
        return greedy
    probs = process_logits(logits, params)
    drawn = (probs / exponential_noise(params.seed, positions, probs.shape[-1])).argmax(dim=-1)
    return torch.where(params.greedy, greedy, drawn)
