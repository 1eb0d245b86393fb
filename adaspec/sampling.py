"""Sampling parameters and the batched sampler.

`SamplingParams` is what a user asks for; `Sampler` turns a batch of logits into tokens.
Both are deliberately free of engine state: the sampler is a pure function of
(logits, params, generators), which is what lets verification reuse it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Per-request generation controls (OpenAI / vLLM meaning).

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p 1.0 and min_p 0.0
    disable those filters. `seed` makes a request's sampling reproducible regardless of what
    else is in the batch. `speculate=False` opts the request out of speculation;
    `max_draft_tokens` caps its draft budget.
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
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
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A per-request generator for seeded requests; None means 'use the engine's stream'."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _device_tensor(values: list, device: torch.device) -> torch.Tensor:
    """A small per-request parameter tensor on `device` without waiting for the device (a
    copy from pageable memory would wait for the stream, and so for the step in flight)."""
    t = torch.tensor(values, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


def process_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Return probabilities [N, V] after temperature, top-k, top-p and min-p.

    Greedy rows become one-hot on the argmax so callers can treat every row alike.
    Pure function: no randomness, no state.
    """
    logits = logits.float()
    n, vocab = logits.shape
    dev = logits.device
    greedy_rows = [p.greedy for p in params]
    greedy = _device_tensor(greedy_rows, dev)
    temps = _device_tensor([p.temperature if not p.greedy else 1.0 for p in params], dev)
    logits = logits / temps.unsqueeze(1)

    top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]
    if any(k < vocab for k in top_ks):
        k_t = _device_tensor(top_ks, dev).clamp(max=vocab)
        sorted_logits = logits.sort(dim=-1, descending=True).values
        kth = sorted_logits.gather(1, (k_t - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))

    probs = torch.softmax(logits, dim=-1)
    top_ps = [p.top_p for p in params]
    if any(tp < 1.0 for tp in top_ps):
        p_t = _device_tensor(top_ps, dev).unsqueeze(1)
        sorted_probs, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_probs.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        remove_sorted = (cum - sorted_probs) >= p_t
        remove = torch.zeros_like(remove_sorted).scatter(1, idx, remove_sorted)
        probs = probs.masked_fill(remove, 0.0)
    min_ps = [p.min_p for p in params]
    if any(mp > 0.0 for mp in min_ps):
        mp_t = _device_tensor(min_ps, dev).unsqueeze(1)
        thresh = probs.max(dim=-1, keepdim=True).values * mp_t
        probs = probs.masked_fill(probs < thresh, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if any(greedy_rows):
        onehot = torch.zeros_like(probs).scatter(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None],
                      default: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row with the exponential-race trick (argmax p / E, E ~ Exp(1)).

    Rows with their own generator draw their noise from it, so a seeded request gets the
    same tokens whatever batch it shares.
    """
    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        if len(shared) == len(generators):
            noise.exponential_(generator=default)
        else:
            idx = _device_tensor(shared, probs.device)
            noise[idx] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(generator=default)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def uniform(generator: torch.Generator | None, device: torch.device,
            default: torch.Generator | None = None) -> float:
    """One U(0,1) draw from the request's generator (or the engine's)."""
    return float(torch.rand(1, device=device, generator=generator or default).item())
