"""Simulated acceptance, for benchmarks only: NOT lossless. Each draft is accepted with a
fixed probability, so the cost side of speculation (every forward, the draft, verification) is
real while acceptance does not depend on random weights. The emitted tokens are the drafts
along the path, then the target's choice as the bonus; same outputs as `verifier.verify`.

The draws (`accept` [B, >= D] bool) are counter-based: request r's d-th draft at its s-th
verify step is accepted iff u(key_r, s, d) < rate, with key_r a hash of r's prompt and the
seed. So a request sees the same acceptance whatever it shares its steps with and on every
server: two runs of one configuration differ only in timing. (With draws from one stream
consumed batch by batch, which requests shared a step moved every later draw: two servers of one
configuration made 0.98-1.03x each other at 8 waves a level; with these draws 0.999-1.009x. H100,
benchmarks/results/h100/session24_2026-12-05/.)
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from adaspec.spec_decode.verifier import chain_path, walk


def simulate(tokens: torch.Tensor, parents: torch.Tensor | None, limit: torch.Tensor, choice: torch.Tensor,
             accept: torch.Tensor, depth: int, legal: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept the best (first) child at depth d when accept[:, d-1]; `parents` None = chains.
    `legal` [B, N] bool (grammar requests): a node whose token its parent's grammar mask
    forbids is never accepted, so simulated output still follows each request's grammar. (The
    host has already replaced the forbidden drafts on the path this takes by legal tokens,
    `structured.bitmask.step_bitmask`'s legalize, so acceptance does not depend on a random
    head's tokens; `legal` still guards what that walk could not replace.)"""
    if parents is None:
        ok = accept[:, : tokens.shape[1] - 1]
        path, acc = chain_path(ok & legal[:, 1:] if legal is not None else ok, limit)
    else:
        def pick(cur, d, children):
            first = torch.where(children.any(1), children.int().argmax(1), torch.full_like(cur, -1))
            ok = accept[:, d - 1] if legal is None else accept[:, d - 1] & legal.gather(1, first.clamp(min=0)[:, None])[:, 0]
            return torch.where(ok, first, torch.full_like(cur, -1))

        path, acc = walk(parents, limit, depth, pick)
    # The drafts along the path (node d's token in column d-1), then the bonus after the last.
    emitted = tokens.gather(1, torch.cat([path[:, 1:], path[:, :1]], dim=1))
    bonus = choice.gather(1, path.gather(1, acc.unsqueeze(1)))
    emitted.scatter_(1, acc.unsqueeze(1), bonus)
    return path, emitted, acc + 1


_M64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def request_key(prompt_token_ids, seed: int) -> int:
    """The 64-bit key of a request's draws: a hash of its prompt's tokens and `seed` (the
    engine's simulate_seed), the same on every server for the same prompt. So requests with one
    prompt (n > 1, a repeated prompt) draw alike: each still accepts a draft with the rate's
    probability, but their acceptances move together."""
    h = hashlib.blake2b(np.asarray(prompt_token_ids, dtype=np.int64).tobytes(), digest_size=8,
                        salt=(seed & _M64).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def uniforms(keys: np.ndarray, steps: np.ndarray, depth: int) -> np.ndarray:
    """u(key, step, d) in [0, 1) for d = 1..depth: [len(keys), depth] float64, a function of its
    arguments alone (53 bits of a splitmix64 chain over key, step and d)."""
    # (uint64 arrays wrap without a warning, as splitmix64 wants)
    base = _mix(np.asarray(keys, np.uint64) + _mix(np.asarray(steps, np.uint64) + np.uint64(0x9E3779B97F4A7C15)))
    d = np.arange(1, depth + 1, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
    x = _mix(base[:, None] ^ d[None, :])
    return (x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def simulated_draws(reqs, pad: int, N: int, rate: float | None, seed: int = 0) -> np.ndarray | None:
    """Whether each draft of the requests `reqs` (engine Requests, N - 1 drafts each) is accepted
    at this verify step, with probability `rate`; counts the step (each request's `sim_steps`,
    its key cached in `sim_key`). `pad` padding rows draw nothing (all False). None when
    acceptance is not simulated (nothing counted)."""
    if rate is None:
        return None
    keys = np.empty(len(reqs), dtype=np.uint64)
    steps = np.empty(len(reqs), dtype=np.uint64)
    for i, r in enumerate(reqs):
        if r.sim_key is None:
            r.sim_key = request_key(r.prompt_token_ids, seed)
        keys[i], steps[i] = r.sim_key, r.sim_steps
        r.sim_steps += 1
    acc = uniforms(keys, steps, max(1, N - 1)) < rate
    return np.concatenate([acc, np.zeros((pad, acc.shape[1]), dtype=bool)]) if pad else acc
