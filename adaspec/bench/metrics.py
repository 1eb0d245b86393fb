"""Statistics of one sweep level and speculative-decoding counters from Prometheus text.

`level_metrics` turns the `RequestResult`s of a level into the figures `vllm bench serve`
reports, with the same field names (``request_throughput``, ``mean_ttft_ms``, ...).
Latency statistics of an empty sample are None (JSON null), never 0.

`parse_prometheus_text` reads the text exposition format; `spec_counters` picks the
speculation counters of adaspec or vLLM out of it and `spec_delta` turns two scrapes (before
and after a level) into acceptance figures over that level:

  * adaspec: ``adaspec_spec_verify_steps_total``, ``adaspec_spec_draft_tokens_total``,
    ``adaspec_spec_accepted_tokens_total``, ``adaspec_spec_accepted_per_position_total{position}``,
    ``adaspec_spec_drafted_per_position_total{position}``;
  * vLLM: ``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
    ``vllm:spec_decode_num_accepted_tokens_total``,
    ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`` (each draft proposes one
    token per position, so a position's drafted count is the number of drafts).

acceptance length = 1 + accepted / verify steps (emitted tokens per verify step, bonus
token included); per-position rate = accepted at position i / drafted at position i.
Samples are summed over all other labels (model name, engine index), and a counter is found
with or without its ``_total`` suffix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from adaspec.bench.client import RequestResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation (numpy's default, as vLLM);
    None for an empty sample."""
    if len(values) == 0:
        return None
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), p))


def summarize(name: str, values_ms: Sequence[float]) -> dict[str, float | None]:
    """``mean_{name}_ms``, ``median_{name}_ms``, ``std_{name}_ms``, ``p99_{name}_ms``."""
    if len(values_ms) == 0:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", "p99")}
    arr = np.asarray(values_ms, dtype=np.float64)
    return {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": percentile(arr, 50),
            f"std_{name}_ms": float(arr.std()), f"p99_{name}_ms": percentile(arr, 99)}


def level_metrics(results: Sequence[RequestResult], duration: float) -> dict:
    """Figures of one level. `duration` (s) runs from the first send to the last answer.

    Throughputs count successful requests only. TPOT of a request is
    (E2EL - TTFT) / (output_tokens - 1) and is defined only for requests with more than one
    output token; ITL pools the gaps between token chunks of all requests.
    """
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = duration if duration > 0 else float("nan")
    out: dict = {
        "num_requests": len(results), "completed": len(ok), "failed": len(failed),
        "duration": duration, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur, "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    ms = 1000.0
    series = {
        "ttft": [r.ttft * ms for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) * ms for r in ok if r.output_tokens > 1],
        "itl": [g * ms for r in ok for g in r.itl],
        "e2el": [r.latency * ms for r in ok],
    }
    for name in LATENCY_METRICS:
        out.update(summarize(name, series[name]))
    for k in ("request_throughput", "output_throughput", "total_token_throughput"):
        if math.isnan(out[k]):
            out[k] = None
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error] = errors.get(r.error, 0) + 1
    out["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5])
    return out


# --------------------------------------------------------------------------- Prometheus

@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus_text(text: str) -> list[Sample]:
    """All samples of a Prometheus text-format page (prometheus_client's parser). A page the
    parser refuses gives no samples (the sweep then reports no speculation figures)."""
    try:
        return [Sample(s.name, dict(s.labels), float(s.value))
                for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (ValueError, TypeError, IndexError):
        return []


def _total(samples: Iterable[Sample], name: str) -> float | None:
    """Sum of the counter `name` (with or without `_total`) over all label sets."""
    found = None
    for wanted in (name + "_total", name):
        for s in samples:
            if s.name == wanted:
                found = (found or 0.0) + s.value
        if found is not None:
            return found
    return None


def _per_position(samples: Iterable[Sample], name: str, label: str = "position") -> dict[int, float]:
    """{integer label value: summed counter} of counter `name` (e.g. by draft position)."""
    for wanted in (name + "_total", name):
        by_pos: dict[int, float] = {}
        for s in samples:
            if s.name == wanted and label in s.labels:
                try:
                    pos = int(s.labels[label])
                except ValueError:
                    continue
                by_pos[pos] = by_pos.get(pos, 0.0) + s.value
        if by_pos:
            return by_pos
    return {}


@dataclass
class SpecCounters:
    """Cumulative speculation counters of one scrape. `steps` is verify steps (adaspec) or
    drafts (vLLM); `drafted_per_pos` is None when the server does not export it (vLLM),
    in which case each position's drafted count is `steps`."""

    source: str
    steps: float
    accepted: float
    draft_tokens: float | None = None
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    drafted_per_pos: dict[int, float] | None = None
    draft_len_steps: dict[int, float] | None = None   # engine steps by draft length (adaspec)


_SCHEMAS = {
    "adaspec": ("adaspec_spec_verify_steps", "adaspec_spec_accepted_tokens",
                "adaspec_spec_draft_tokens", "adaspec_spec_accepted_per_position",
                "adaspec_spec_drafted_per_position"),
    "vllm": ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
             "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
             None),
}


def spec_counters(text: str | None) -> SpecCounters | None:
    """The speculation counters in a /metrics page (adaspec's names first, then vLLM's), or
    None when the page is missing or has neither set."""
    if not text:
        return None
    samples = parse_prometheus_text(text)
    for source, (steps_n, acc_n, draft_n, acc_pos_n, drafted_pos_n) in _SCHEMAS.items():
        steps, acc = _total(samples, steps_n), _total(samples, acc_n)
        if steps is None or acc is None:
            continue
        return SpecCounters(source=source, steps=steps, accepted=acc,
                            draft_tokens=_total(samples, draft_n),
                            accepted_per_pos=_per_position(samples, acc_pos_n),
                            drafted_per_pos=_per_position(samples, drafted_pos_n) if drafted_pos_n else None,
                            draft_len_steps=(_per_position(samples, "adaspec_spec_draft_len_steps", "draft_len")
                                             if source == "adaspec" else None))
    return None


SPEC_FIELDS = ("spec_metrics_source", "spec_verify_steps", "spec_draft_tokens",
               "spec_accepted_tokens", "acceptance_length", "acceptance_rate",
               "per_position_acceptance_rate", "mean_draft_len")


def spec_delta(before: SpecCounters | None, after: SpecCounters | None) -> dict:
    """Acceptance figures over the interval between two scrapes; every field in
    `SPEC_FIELDS` is present, None when unknown (no metrics, no verify step in the interval,
    or counters that went backwards, i.e. a server restart)."""
    out: dict = {k: None for k in SPEC_FIELDS}
    if before is None or after is None or before.source != after.source:
        return out
    steps = after.steps - before.steps
    acc = after.accepted - before.accepted
    if steps < 0 or acc < 0:
        return out
    out["spec_metrics_source"] = after.source
    out["spec_verify_steps"] = int(round(steps))
    out["spec_accepted_tokens"] = int(round(acc))
    if after.draft_tokens is not None and before.draft_tokens is not None:
        drafted = after.draft_tokens - before.draft_tokens
        out["spec_draft_tokens"] = int(round(drafted))
        if drafted > 0:
            out["acceptance_rate"] = acc / drafted
    if after.draft_len_steps and before.draft_len_steps is not None:
        # The draft length the policy chose, averaged over the interval's engine steps (0: none).
        d = {k: v - before.draft_len_steps.get(k, 0.0) for k, v in after.draft_len_steps.items()}
        n = sum(d.values())
        if n > 0 and min(d.values()) >= 0:
            out["mean_draft_len"] = sum(k * v for k, v in d.items()) / n
    if steps > 0:
        out["acceptance_length"] = 1.0 + acc / steps
        rates = []
        for pos in range(max(after.accepted_per_pos, default=-1) + 1):
            a = after.accepted_per_pos.get(pos, 0.0) - before.accepted_per_pos.get(pos, 0.0)
            if after.drafted_per_pos is not None:
                d = after.drafted_per_pos.get(pos, 0.0) - (before.drafted_per_pos or {}).get(pos, 0.0)
            else:
                d = steps
            rates.append(a / d if d > 0 else None)
        out["per_position_acceptance_rate"] = rates or None
    return out
