"""Prometheus metrics of the server, in a private registry (several servers may share a process).

Two sources:
  * Request latencies and outcomes are observed by the server as outputs reach the event loop
    (`ServerMetrics.on_output`, `on_abort`, `on_rejected`).
  * Engine figures (tokens, queue, KV blocks, speculation) are read at scrape time from the
    snapshot of `engine.stats()` the engine thread takes after every step (`EngineStatsCollector`),
    so a scrape never touches the engine and every engine number comes from one consistent step.

Counter names below are base names; the text exposition appends `_total`.
Speculation metrics (exact names other tools rely on):
  adaspec_spec_verify_steps, adaspec_spec_draft_tokens, adaspec_spec_accepted_tokens,
  adaspec_spec_accepted_per_position{position}, adaspec_spec_drafted_per_position{position}
  (position is the 0-based draft depth: "0" is the first draft token after the verified one),
  adaspec_spec_steps, adaspec_nonspec_steps, adaspec_spec_draft_len_steps{draft_len} (counters);
  adaspec_spec_draft_len (the policy's current draft length), adaspec_spec_accept_length (gauges).
vLLM's names, beside adaspec's own, so dashboards made for vLLM work unchanged (every one
labelled model_name, as vLLM labels them; request_success with finished_reason):
  vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (a fraction,
  0..1, as vLLM reports it) and its older name vllm:gpu_cache_usage_perc (gauges);
  vllm:prompt_tokens, vllm:generation_tokens, vllm:num_preemptions, vllm:prefix_cache_queries
  (prompt tokens looked up), vllm:prefix_cache_hits (tokens found), vllm:request_success
  {finished_reason}, vllm:spec_decode_num_drafts (verify steps), vllm:spec_decode_num_draft_tokens,
  vllm:spec_decode_num_accepted_tokens, vllm:spec_decode_num_accepted_tokens_per_pos{position}
  (counters); vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
  vllm:e2e_request_latency_seconds, vllm:request_{queue,prefill,decode,inference}_time_seconds,
  vllm:request_prompt_tokens, vllm:request_generation_tokens (histograms, the same
  observations as adaspec's adaspec_request_* ones; phases: see PHASES below).
Inter-token latency is per token: an output that brings k tokens after a gap of d seconds counts
k observations of d/k, so speculation that emits several tokens per step shows up as lower ITL.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0)
# Tokens per request: 1, 2, 5, 10, ... up to 1M (vLLM's 1-2-5 series).
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 1_000_000)
# The phases of a request (seconds), measured when it finishes:
#   queue      arrival at the engine -> first scheduled (RequestOutput.queue_time)
#   prefill    the rest of the time to the first token (prompt processing, and the server's
#              tokenizing before the engine saw it)
#   decode     first token -> last token
#   inference  first scheduled -> last token
PHASES = ("queue", "prefill", "decode", "inference")


class EngineStatsCollector:
    """Turns the latest engine stats snapshot (+ the server's in-flight count) into metrics."""

    def __init__(self, stats_fn: Callable[[], dict], inflight_fn: Callable[[], int], model_name: str = ""):
        self._stats_fn = stats_fn
        self._inflight_fn = inflight_fn
        self._model_name = model_name

    def describe(self):
        return []  # names are static, but describing them would force a collect() at register time

    def collect(self):
        s = self._stats_fn() or {}

        def gauge(name, doc, key):
            return GaugeMetricFamily(name, doc, value=float(s.get(key, 0) or 0))

        def counter(name, doc, key):
            return CounterMetricFamily(name, doc, value=float(s.get(key, 0) or 0))

        yield gauge("adaspec_num_requests_running", "Requests in the running batch.", "num_running")
        yield gauge("adaspec_num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting")
        yield GaugeMetricFamily("adaspec_num_requests_inflight",
                                "Requests accepted by the server and not finished.",
                                value=float(self._inflight_fn()))
        yield gauge("adaspec_kv_free_blocks", "Free KV-cache blocks.", "num_free_blocks")
        yield gauge("adaspec_kv_total_blocks", "Total KV-cache blocks.", "num_total_blocks")
        yield counter("adaspec_num_preemptions", "Requests preempted for lack of KV blocks.", "num_preemptions")
        yield counter("adaspec_prompt_tokens", "Prompt tokens admitted.", "prompt_tokens")
        yield counter("adaspec_generation_tokens", "Tokens generated.", "generation_tokens")
        yield counter("adaspec_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache.",
                      "prefix_cache_hit_tokens")

        yield counter("adaspec_spec_verify_steps", "Request-steps that verified draft tokens.", "verify_steps")
        yield counter("adaspec_spec_draft_tokens", "Draft tokens proposed for verification.", "draft_tokens")
        yield counter("adaspec_spec_accepted_tokens", "Draft tokens accepted.", "accepted_tokens")
        yield counter("adaspec_spec_steps", "Engine steps that speculated.", "spec_steps")
        yield counter("adaspec_nonspec_steps", "Engine steps without speculation.", "nonspec_steps")
        for name, doc, key in (
                ("adaspec_spec_accepted_per_position", "Accepted draft tokens by draft position.",
                 "accepted_per_position"),
                ("adaspec_spec_drafted_per_position", "Verified draft chains reaching a draft position.",
                 "drafted_per_position")):
            fam = CounterMetricFamily(name, doc, labels=["position"])
            for i, v in enumerate(s.get(key) or []):
                fam.add_metric([str(i)], float(v))
            yield fam
        fam = CounterMetricFamily("adaspec_spec_draft_len_steps", "Engine steps by per-request draft length.",
                                  labels=["draft_len"])
        for k, v in sorted((s.get("draft_len_histogram") or {}).items(), key=lambda kv: int(kv[0])):
            fam.add_metric([str(k)], float(v))
        yield fam
        yield gauge("adaspec_spec_draft_len", "Draft tokens per request chosen by the policy in the last step.",
                    "last_draft_len")
        yield gauge("adaspec_spec_accept_length",
                    "Average tokens emitted per verify step (accepted + bonus).", "accept_length")
        info = GaugeMetricFamily("adaspec_spec_policy_info", "The speculation policy.", labels=["policy"])
        info.add_metric([str(s.get("policy", ""))], 1.0)
        yield info
        yield from self._vllm(s)

    def _vllm(self, s: dict):
        """The same figures under vLLM's names (see the module docstring)."""
        model = [self._model_name]

        def family(kind, name, doc, value):
            fam = kind(name, doc, labels=["model_name"])
            fam.add_metric(model, float(value or 0))
            return fam

        total = float(s.get("num_total_blocks", 0) or 0)
        usage = 1.0 - float(s.get("num_free_blocks", 0) or 0) / total if total else 0.0
        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.",
                     s.get("num_running"))
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                     s.get("num_waiting"))
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", usage)
        yield family(GaugeMetricFamily, "vllm:gpu_cache_usage_perc",
                     "KV-cache usage (1 = full); vLLM's older name.", usage)
        for name, doc, key in (
                ("vllm:prompt_tokens", "Prompt tokens admitted.", "prompt_tokens"),
                ("vllm:generation_tokens", "Tokens generated.", "generation_tokens"),
                ("vllm:num_preemptions", "Requests preempted for lack of KV blocks.", "num_preemptions"),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prompt_tokens"),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hit_tokens"),
                ("vllm:spec_decode_num_drafts", "Draft chains or trees verified.", "verify_steps"),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", "draft_tokens"),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "accepted_tokens")):
            yield family(CounterMetricFamily, name, doc, s.get(key))
        fam = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted draft tokens by draft position.", labels=["model_name", "position"])
        for i, v in enumerate(s.get("accepted_per_position") or []):
            fam.add_metric([self._model_name, str(i)], float(v))
        yield fam


class ServerMetrics:
    """All server metrics; `render()` is the /metrics body."""

    def __init__(self, stats_fn: Callable[[], dict], inflight_fn: Callable[[], int], model_name: str = ""):
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        self.request_success = Counter("adaspec_request_success", "Finished requests by finish reason.",
                                       ["finish_reason"], registry=r)
        self.request_rejected = Counter("adaspec_request_rejected",
                                        "Requests answered with an error, by reason.", ["reason"], registry=r)
        self.ttft = Histogram("adaspec_time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("adaspec_inter_token_latency_seconds", "Latency per output token after the first.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("adaspec_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.client_disconnects = Counter(
            "adaspec_client_disconnects", "Requests whose client went away before the answer was complete "
            "(not errors; their engine requests are aborted).", ["kind"], registry=r)
        self.vllm_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                    ["model_name", "finished_reason"], registry=r)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", ["model_name"],
                                   buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Latency per output token after the first.",
                                  ["model_name"], buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", ["model_name"],
                                  buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.phase: dict[str, tuple] = {}
        for phase in PHASES:
            doc = f"Request {phase} time (see adaspec/server/metrics.py)."
            self.phase[phase] = (
                Histogram(f"adaspec_request_{phase}_time_seconds", doc, buckets=E2E_BUCKETS, registry=r),
                Histogram(f"vllm:request_{phase}_time_seconds", doc, ["model_name"], buckets=E2E_BUCKETS,
                          registry=r).labels(model_name))
        self.request_tokens: dict[str, tuple] = {}
        for kind in ("prompt", "generation"):
            doc = f"{kind.capitalize()} tokens per finished request."
            self.request_tokens[kind] = (
                Histogram(f"adaspec_request_{kind}_tokens", doc, buckets=TOKEN_BUCKETS, registry=r),
                Histogram(f"vllm:request_{kind}_tokens", doc, ["model_name"], buckets=TOKEN_BUCKETS,
                          registry=r).labels(model_name))
        r.register(EngineStatsCollector(stats_fn, inflight_fn, model_name))

    def on_output(self, stream, out, now: float) -> None:
        """Called by the event loop for each output, BEFORE the stream's timestamps are updated."""
        k = len(out.new_token_ids)
        if k:
            if stream.first_token_time is None:
                self.ttft.observe(now - stream.arrival)
                self.vllm_ttft.observe(now - stream.arrival)
            else:
                gap = (now - stream.last_token_time) / k
                for _ in range(k):
                    self.itl.observe(gap)
                    self.vllm_itl.observe(gap)
        if out.finished:
            self._finished(out.finish_reason or "unknown")
            self.e2e.observe(now - stream.arrival)
            self.vllm_e2e.observe(now - stream.arrival)
            self._request_done(stream, out, now)

    def _request_done(self, stream, out, now: float) -> None:
        """The per-request histograms of a finished request (phases, token counts)."""
        def observe(pair, value: float) -> None:
            for h in pair:
                h.observe(max(0.0, value))

        observe(self.request_tokens["prompt"], len(getattr(out, "prompt_token_ids", None) or ()))
        observe(self.request_tokens["generation"], len(getattr(out, "token_ids", None) or ()))
        first = stream.first_token_time if stream.first_token_time is not None else now
        if not getattr(out, "token_ids", None):   # nothing generated: no prefill or decode to time
            return
        queued = getattr(out, "queue_time", None)
        queued = 0.0 if queued is None else queued
        observe(self.phase["queue"], queued)
        observe(self.phase["prefill"], first - stream.arrival - queued)
        observe(self.phase["decode"], now - first)
        observe(self.phase["inference"], now - stream.arrival - queued)

    def _finished(self, reason: str) -> None:
        self.request_success.labels(reason).inc()
        self.vllm_success.labels(self.model_name, reason).inc()

    def on_abort(self, stream) -> None:
        self._finished("abort")

    def on_disconnect(self, kind: str) -> None:
        """`kind`: "stream" or "non_stream"."""
        self.client_disconnects.labels(kind).inc()

    def on_rejected(self, reason: str) -> None:
        self.request_rejected.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
