"""The periodic stats line (vLLM's habit), so an operator sees load and what speculation does:

  Avg prompt throughput: 412.3 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 4 reqs,
  Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0% | speculation auto: draft
  length 3 (last step), acceptance length 2.41, 47.0% of draft tokens accepted, 88% of steps
  speculated, goodput by draft length {0: 810.2, 1: 1012.5, 3: 1190.0}

Throughputs and speculation figures are over the interval since the previous line (from two
snapshots of `engine.stats()`); nothing is logged for an interval with no work.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

logger = logging.getLogger("adaspec.server")


def _delta(cur: dict, prev: dict, key: str) -> float:
    return float(cur.get(key, 0) or 0) - float(prev.get(key, 0) or 0)


def stats_line(prev: dict, cur: dict, seconds: float) -> str | None:
    """The line for the interval from snapshot `prev` to `cur` (`seconds` apart), or None when
    the engine did nothing and holds nothing."""
    prompt, gen = _delta(cur, prev, "prompt_tokens"), _delta(cur, prev, "generation_tokens")
    running, waiting = int(cur.get("num_running", 0) or 0), int(cur.get("num_waiting", 0) or 0)
    if not (prompt or gen or running or waiting):
        return None
    seconds = max(seconds, 1e-9)
    total = float(cur.get("num_total_blocks", 0) or 0)
    usage = 100.0 * (1.0 - float(cur.get("num_free_blocks", 0) or 0) / total) if total else 0.0
    hits = _delta(cur, prev, "prefix_cache_hit_tokens")
    line = (f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, Avg generation throughput: "
            f"{gen / seconds:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {usage:.1f}%, Prefix cache hit rate: {100.0 * hits / prompt if prompt else 0.0:.1f}%")
    policy = cur.get("policy")
    if policy and policy != "off":
        verify, drafted = _delta(cur, prev, "verify_steps"), _delta(cur, prev, "draft_tokens")
        accepted = _delta(cur, prev, "accepted_tokens")
        spec, plain = _delta(cur, prev, "spec_steps"), _delta(cur, prev, "nonspec_steps")
        line += f" | speculation {policy}: draft length {cur.get('last_draft_len', 0)} (last step)"
        if verify:
            line += (f", acceptance length {1.0 + accepted / verify:.2f}, "
                     f"{100.0 * accepted / drafted if drafted else 0.0:.1f}% of draft tokens accepted")
        if spec + plain:
            line += f", {100.0 * spec / (spec + plain):.0f}% of steps speculated"
        goodput = (cur.get("policy_state") or {}).get("goodput")
        if goodput:
            line += f", goodput by draft length {goodput}"
    return line


async def log_stats_forever(stats_fn: Callable[[], dict], interval_s: float) -> None:
    """Log `stats_line` every `interval_s` seconds (a task of the server's lifespan)."""
    prev, t_prev = dict(stats_fn()), time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        cur, now = dict(stats_fn()), time.monotonic()
        line = stats_line(prev, cur, now - t_prev)
        if line is not None:
            logger.info("%s", line)
        prev, t_prev = cur, now
