"""The sweep: warm up, then run each level and measure it.

A level is either closed loop - exactly `concurrency` requests in flight, a finished request
immediately replaced by the next, until the level's prompts run out - or open loop -
requests arrive as a Poisson process of `request_rate` per second (all at once for an
infinite rate), optionally capped at `concurrency` in flight.

Each level sends `num_prompts` fresh requests from the dataset stream (see
`adaspec.bench.datasets`) and, when the server exposes Prometheus ``/metrics``, scrapes it
before and after the level to report the speculation acceptance over exactly that level.
Warm-up requests run once before the first level and are not counted.
"""
from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from adaspec.bench.client import (ApiTarget, BenchError, RequestResult, ServerUnreachable,
                                  first_model_id, get_json, get_text, make_client, send_request)
from adaspec.bench.datasets import Dataset, SampleRequest
from adaspec.bench.metrics import level_metrics, spec_counters, spec_delta


@dataclass(frozen=True)
class Level:
    """Closed loop when `request_rate` is None (then `concurrency` is required), else open
    loop at `request_rate` req/s (math.inf: all at once) with `concurrency` as an optional cap."""

    concurrency: int | None = None
    request_rate: float | None = None

    def __post_init__(self) -> None:
        if self.request_rate is None and (self.concurrency is None or self.concurrency < 1):
            raise ValueError("a closed-loop level needs concurrency >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate}")

    @property
    def closed_loop(self) -> bool:
        return self.request_rate is None

    @property
    def label(self) -> str:
        if self.closed_loop:
            return f"c={self.concurrency}"
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"rate={rate}" + (f",max={self.concurrency}" if self.concurrency else "")

    def to_json(self) -> dict:
        rate = self.request_rate
        return {"mode": "closed" if self.closed_loop else "open",
                "concurrency": self.concurrency if self.closed_loop else None,
                "max_concurrency": None if self.closed_loop else self.concurrency,
                "request_rate": None if rate is None else ("inf" if math.isinf(rate) else rate)}


@dataclass(frozen=True)
class SweepConfig:
    """`num_prompts`: requests per level, one number for all or one per level.
    `prompt_starts`: the dataset index of each level's first request (default: the levels
    one after another, after the warm-up's `num_warmup` requests); giving them lets a sweep
    of some of the levels send the same requests per level as a sweep of all of them."""

    levels: tuple[Level, ...]
    num_prompts: int | tuple[int, ...]
    num_warmup: int = 2
    seed: int = 0                 # seeds the Poisson arrivals (the dataset has its own seed)
    scrape_metrics: bool = True
    progress: bool = True
    prompt_starts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("no levels to sweep")
        counts = self.num_prompts if isinstance(self.num_prompts, tuple) else (self.num_prompts,)
        if isinstance(self.num_prompts, tuple) and len(counts) != len(self.levels):
            raise ValueError(f"{len(counts)} prompt counts for {len(self.levels)} levels")
        if any(n < 1 for n in counts):
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup must be >= 0, got {self.num_warmup}")
        if self.prompt_starts is not None:
            if len(self.prompt_starts) != len(self.levels):
                raise ValueError(f"{len(self.prompt_starts)} prompt starts for {len(self.levels)} levels")
            if any(s < self.num_warmup for s in self.prompt_starts):
                raise ValueError("a level's prompts may not start inside the warm-up's "
                                 f"(indices < {self.num_warmup})")

    def level_prompts(self, j: int) -> int:
        """Requests of level j."""
        return self.num_prompts[j] if isinstance(self.num_prompts, tuple) else self.num_prompts

    def level_start(self, j: int) -> int:
        """Dataset index of level j's first request."""
        if self.prompt_starts is not None:
            return self.prompt_starts[j]
        return self.num_warmup + sum(self.level_prompts(i) for i in range(j))


def find_simulated_acceptance(info: Any) -> float | None:
    """``spec_simulate_accept_rate`` from a /server_info answer, at the top or nested in a
    sub-object; None when absent or null."""
    if isinstance(info, dict):
        v = info.get("spec_simulate_accept_rate")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        for sub in info.values():
            found = find_simulated_acceptance(sub)
            if found is not None:
                return found
    return None


async def _closed_loop(client, target: ApiTarget, samples: list[SampleRequest], concurrency: int,
                       bar: tqdm) -> list[RequestResult]:
    results: list[RequestResult | None] = [None] * len(samples)
    next_idx = 0

    async def worker() -> None:
        nonlocal next_idx
        while next_idx < len(samples):
            i = next_idx
            next_idx += 1
            results[i] = await send_request(client, target, samples[i])
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(samples)))))
    return [r for r in results if r is not None]


async def _open_loop(client, target: ApiTarget, samples: list[SampleRequest], rate: float,
                     cap: int | None, rng: np.random.Generator, bar: tqdm) -> list[RequestResult]:
    sem = asyncio.Semaphore(cap) if cap else None

    async def one(s: SampleRequest) -> RequestResult:
        if sem is None:
            res = await send_request(client, target, s)
        else:
            async with sem:
                res = await send_request(client, target, s)
        bar.update(1)
        return res

    tasks = []
    t0 = time.perf_counter()
    arrival = 0.0
    for s in samples:
        if not math.isinf(rate):
            arrival += float(rng.exponential(1.0 / rate))
            delay = t0 + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(s)))
    return list(await asyncio.gather(*tasks))


async def run_level(client, target: ApiTarget, samples: list[SampleRequest], level: Level, *,
                    seed: int = 0, progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send `samples` at `level`; returns the results (in sample order) and the duration
    from the first send to the last answer, in seconds."""
    bar = tqdm(total=len(samples), desc=level.label, file=sys.stderr, disable=not progress,
               unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()
    try:
        if level.closed_loop:
            results = await _closed_loop(client, target, samples, level.concurrency, bar)
        else:
            rng = np.random.default_rng([seed, int(min(level.request_rate, 1e9) * 1000)])
            results = await _open_loop(client, target, samples, level.request_rate,
                                       level.concurrency, rng, bar)
    finally:
        bar.close()
    return results, time.perf_counter() - t0


async def probe_server(client, base_url: str, model: str | None) -> tuple[str, dict | None]:
    """Check the server answers and resolve the model name (first id of /v1/models when
    `model` is None). Returns (model, /server_info JSON or None).
    Raises `ServerUnreachable` when nothing answers at `base_url`."""
    base = base_url.rstrip("/")
    if model is None:
        model = await first_model_id(client, base)
    else:
        await get_json(client, base + "/v1/models")     # raises ServerUnreachable if down
    return model, await get_json(client, base + "/server_info")


async def run_sweep(target: ApiTarget, dataset: Dataset, cfg: SweepConfig,
                    on_level: Callable[[dict], None] | None = None) -> dict:
    """Warm up, run every level of `cfg` against `target` and return
    ``{"model", "server_info", "simulated_acceptance", "warmup", "levels": [...]}`` where each
    level dict holds `Level.to_json()`, `level_metrics` and `spec_delta` fields.

    `target.model` may be empty: it is then resolved from /v1/models. Raises
    `ServerUnreachable` if the server does not answer, `BenchError` if every warm-up request
    fails. `on_level` is called with each finished level's dict.
    """
    base = target.base_url.rstrip("/")
    max_conn = max([lv.concurrency or 0 for lv in cfg.levels] + [cfg.num_warmup, 1])
    unlimited = any(not lv.closed_loop and lv.concurrency is None for lv in cfg.levels)
    async with make_client(None if unlimited else max_conn + 4) as client:
        model, info = await probe_server(client, base, target.model or None)
        if model != target.model:
            target = ApiTarget(**{**target.__dict__, "model": model})
        out: dict = {"model": model, "server_info": info,
                     "simulated_acceptance": find_simulated_acceptance(info),
                     "warmup": None, "levels": []}
        if cfg.num_warmup:
            warm = dataset.sample(cfg.num_warmup, 0)
            t0 = time.perf_counter()
            res = await asyncio.gather(*(send_request(client, target, s) for s in warm))
            out["warmup"] = {"requests": len(res), "completed": sum(r.success for r in res),
                             "duration": time.perf_counter() - t0}
            if not any(r.success for r in res):
                raise BenchError(f"all {len(res)} warm-up requests to {target.url} failed; "
                                 f"first error: {res[0].error}")
        metrics_url = base + "/metrics"
        for j, level in enumerate(cfg.levels):
            samples = dataset.sample(cfg.level_prompts(j), cfg.level_start(j))
            before = spec_counters(await get_text(client, metrics_url)) if cfg.scrape_metrics else None
            results, duration = await run_level(client, target, samples, level,
                                                seed=cfg.seed, progress=cfg.progress)
            after = spec_counters(await get_text(client, metrics_url)) if cfg.scrape_metrics else None
            entry = {**level.to_json(), "first_prompt": cfg.level_start(j),
                     **level_metrics(results, duration), **spec_delta(before, after)}
            out["levels"].append(entry)
            if on_level is not None:
                on_level(entry)
        return out


__all__ = ["Level", "SweepConfig", "run_sweep", "run_level", "probe_server",
           "find_simulated_acceptance", "ServerUnreachable", "BenchError"]
