"""The engine: the step loop (the offline `LLM` API over it is in `llm.py`).

    plan    = scheduler.schedule()          # policy decides, KV is reserved
    step    = runner.launch(plan)           # draft, target forward, verify: queued on the device
              runner.finish(step)           # (a grammar step's verify: queued once its mask is built)
    results = runner.collect(step)          # wait, read the emitted tokens
    changed = scheduler.postprocess(...)    # commit, stop, roll back rejected slots

With overlap (the default) the engine plans and launches step N+1 before it collects step N,
so the CPU work of one step hides behind the device work of the other. Step N+1 is planned as
if every request of step N emitted one token; where N speculated, N+1 reserves KV for N's
whole draft and the runner shifts N+1's positions on the device by what N really emitted. The
engine waits for step N before planning only when the runner cannot shift (`plans_ahead`).
A step with a grammar is launched up to its target forward; its verification is queued
(`runner.finish`) after step N is applied, when the matchers know N's tokens.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter

import numpy as np

from adaspec.config import EngineConfig
from adaspec.engine import gc_heap
from adaspec.engine.detokenizer import Detokenizer
from adaspec.engine.kv_cache import KVCacheManager
from adaspec.engine.request import Request, RequestOutput, SpecStats
from adaspec.engine.runner import ModelRunner
from adaspec.engine.scheduler import Scheduler
from adaspec.engine.step_plan import StepPlan, StepResult
from adaspec.engine.step_clock import StepClock
from adaspec.models.registry import generation_defaults
from adaspec.sampling import SamplingParams, random_seed
from adaspec.spec_decode.policy import StepFeedback, make_policy
from adaspec.tokenization import bad_word_ids, load_tokenizer, tokenize, truncate_prompt

log = logging.getLogger("adaspec")

def check_request(prompt: str | list[int], params: SamplingParams, tokenizer, vocab_size: int,
                  max_model_len: int) -> tuple[list[int], list[tuple[int, ...]]]:
    """(a request's prompt token ids, its bad words' token sequences), or a ValueError saying
    what is wrong with the request. (Pure: the server's engine process front runs the same
    checks before sending it on.)"""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    ids = tokenize(tokenizer, prompt)
    if not ids:
        raise ValueError("prompt is empty")
    ids = truncate_prompt(ids, params.truncate_prompt_tokens, max_model_len)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} out of range [0, {vocab_size})")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids: {bad[0]} is out of range [0, {vocab_size})")
    for name, given in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in given if t >= vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is out of range [0, {vocab_size})")
    if len(ids) + params.max_tokens > max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                         f"model's context of {max_model_len} tokens")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer; use stop_token_ids")
    return ids, (bad_word_ids(tokenizer, params.bad_words) if params.bad_words else [])


class Engine:
    """The step loop over a scheduler (which decides) and a runner (which executes). `runner`
    is built from `cfg` unless given: any object with ModelRunner's surface (`setup`,
    `launch`, `finish`, `collect`, `plans_ahead`, `last_step_time`, `last_wait`, `num_blocks`,
    `model_spec`, `draft`, `device`, `backend`, `graphs`, `launch_counts`, `pdl`), which is how
    the scheduler/KV invariant tests drive this very loop without a model."""

    def __init__(self, cfg: EngineConfig, runner: ModelRunner | None = None):
        self.config = cfg
        gc_heap.thaw()
        self.runner = runner if runner is not None else self._make_runner(cfg)
        try:
            self._start(cfg)
        except BaseException:
            self.close()   # a tensor-parallel runner's workers go with the failed start
            raise
        gc_heap.freeze()   # full collections walk only what the steps allocate (gc_heap)

    @staticmethod
    def _make_runner(cfg: EngineConfig) -> ModelRunner:
        """The runner; with tensor_parallel_size > 1, rank 0's, after its workers started."""
        if cfg.tensor_parallel_size == 1:
            return ModelRunner(cfg)
        from adaspec.device.select import resolve_device
        from adaspec.engine.tp_driver import TPDriver
        driver = TPDriver.start(cfg, resolve_device(cfg.device))
        try:
            return ModelRunner(cfg, driver=driver)
        except BaseException:
            driver.close()
            raise

    def _start(self, cfg: EngineConfig) -> None:
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, cfg.chat_template)
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        # True: an output's token_ids is the request's own growing list, not a copy (for a
        # consumer that reads only new_token_ids, as the server's engine process does: a copy
        # per request per step is O(output length) of host time for nothing).
        self.delta_outputs = False
        bs = cfg.cache.block_size
        capacity = self.runner.num_blocks * bs - 1
        wanted = cfg.scheduler.max_model_len
        if wanted is not None and wanted > capacity:
            raise ValueError(f"max_model_len={wanted} exceeds the KV cache ({capacity} tokens); "
                             f"give the cache more memory or lower max_model_len")
        trained = self.runner.model_spec.max_position
        if wanted is not None and wanted > trained:   # (vLLM refuses this; rope scaling may cover it)
            log.warning("max_model_len=%d is beyond the model's max_position_embeddings=%d: positions past it "
                        "were never trained and outputs there may degrade", wanted, trained)
        self.max_model_len = min(wanted or trained, capacity)
        self.runner.setup(self.max_model_len)
        self.kv = KVCacheManager(self.runner.num_blocks, bs, cfg.cache.enable_prefix_caching)
        self.policy = make_policy(cfg.spec)
        self.scheduler = Scheduler(cfg.scheduler, self.kv, self.policy, self.max_model_len,
                                   draft_sync=self.runner.draft is not None, detokenizer=self.detokenizer)
        self.requests: dict[str, Request] = {}
        self.spec_stats = SpecStats()
        self.counters = Counter()
        # Host seconds per part of Engine.step, summed (stats "host_ms_per_step"): where a
        # host-bound engine's cycle goes, read back from a served run's shutdown line.
        self.host_times: Counter = Counter()
        self.draft_len_histogram: Counter = Counter()
        self.last_draft_len = 0
        self._ids = itertools.count()
        self.rng = np.random.default_rng(cfg.seed)   # seeds of requests that bring none
        self.sampling_defaults = self._sampling_defaults(cfg)
        # Progress watch: a step that plans nothing while requests are unfinished made no
        # progress. The scheduler's liveness argument says this never lasts; if it does, the
        # server's /health and LLM.generate report it instead of spinning silently.
        self.num_stalled_steps = 0
        self.stalled_since: float | None = None
        self.inflight = None    # the launched step not yet collected (overlap)
        self._clock = StepClock()
        self.grammars = None    # structured.grammar.GrammarCache, built at the first constrained request
        if self.runner.draft is not None and hasattr(self.policy, "warm_up"):
            from adaspec.engine.profile import profile_step_times
            self.policy.warm_up(lambda shapes: profile_step_times(self, shapes))

    @staticmethod
    def _sampling_defaults(cfg: EngineConfig) -> dict:
        """{field: value} for sampling fields a request leaves out: the model's
        generation_config.json with generation_config="auto", nothing with "none"."""
        if cfg.generation_config == "none":
            return {}
        defaults, ignored = generation_defaults(cfg.model)
        try:
            SamplingParams(**defaults)
        except ValueError as e:
            raise ValueError(f"{cfg.model}/generation_config.json: {e} "
                             f"(or start with generation_config='none')") from None
        if ignored:
            log.warning("generation_config.json of %s sets %s, which adaspec does not support: not applied",
                        cfg.model, ", ".join(ignored))
        if defaults:
            log.info("sampling defaults from generation_config.json: %s", defaults)
        return defaults

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the model's defaults (see `sampling_defaults`), then `overrides`."""
        return SamplingParams(**{**self.sampling_defaults, **overrides})

    @classmethod
    def from_kwargs(cls, model: str, **kw) -> "Engine":
        return cls(EngineConfig.create(model, **kw))

    @property
    def vocab_size(self) -> int:
        return self.runner.model_spec.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's stop tokens."""
        return list(self.runner.model_spec.eos_token_ids)

    @property
    def draft_format(self) -> str | None:
        """The upstream layout the EAGLE-3 head was read as (None without a head)."""
        draft = getattr(self.runner, "draft", None)
        return draft.fmt.layout if draft is not None else None

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize(self.tokenizer, prompt)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams) -> str:
        """Validate and queue a request. Raises ValueError saying what is wrong."""
        if params.n != 1:
            raise ValueError(f"n={params.n}: add each choice as its own request (SamplingParams.choices())")
        ids, bad_words = check_request(prompt, params, self.tokenizer, self.vocab_size, self.max_model_len)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        eos = set(self.eos_token_ids)
        seed = params.seed if params.seed is not None else random_seed(self.rng)
        req = Request(request_id, ids, params, eos, seed=seed)
        req.bad_word_ids = bad_words
        if params.structured is not None:
            if self.config.tensor_parallel_size > 1:
                from adaspec.engine.grammar_step import TP_UNSUPPORTED
                raise ValueError(TP_UNSUPPORTED)
            req.grammar = self.grammar_cache().matcher(params.structured)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.counters["prompt_tokens"] += len(ids)
        return request_id

    def grammar_cache(self):
        """The engine's compiled grammars (built at first use: xgrammar loads only then)."""
        if self.grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            from adaspec.structured.grammar import GrammarCache

            self.grammars = GrammarCache.from_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self.grammars

    def abort_request(self, request_id: str) -> None:
        req = self.scheduler.abort(request_id)
        if req is not None:
            self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.inflight is not None

    # ---- the step loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return incremental outputs of the requests that changed. With overlap
        these are the outputs of the previous step, collected after this one was launched."""
        self._clock.call_began()
        try:
            return self._step()
        finally:
            self._clock.call_ended(self.has_unfinished())

    def _step(self) -> list[RequestOutput]:
        changed: list[Request] = []
        if self.inflight is not None and not self.runner.plans_ahead(self.inflight.plan):
            changed += self._collect()
        t = time.perf_counter()
        plan = self.scheduler.schedule()
        self.host_times["schedule"] += time.perf_counter() - t
        if self.inflight is not None and plan.empty:
            changed += self._collect()
        failed = [r for r in self.requests.values() if r.is_finished and r.error]
        if plan.empty:
            if changed or failed or not self.scheduler.has_unfinished():
                self._progressed()
            else:
                self.num_stalled_steps += 1
                if self.stalled_since is None:
                    self.stalled_since = time.monotonic()
            return self._outputs(failed + changed)
        self._progressed()
        t = time.perf_counter()
        launched = self.runner.launch(plan)
        self.host_times["launch"] += time.perf_counter() - t
        self.scheduler.launched(plan)
        if self.inflight is not None:
            self.counters["overlapped_steps"] += 1
            changed += self._collect()
        self.runner.finish(launched)
        self.inflight = launched
        self._clock.launched()
        if not self.config.overlap:
            changed += self._collect()
        return self._outputs(failed + changed)

    def _collect(self) -> list[Request]:
        """Wait for the launched step, apply its results; the requests that changed."""
        step, self.inflight = self.inflight, None
        h, t0 = self.host_times, time.perf_counter()
        results = self.runner.collect(step)
        device = self.runner.last_step_time
        cost = self._clock.collected(self.runner.last_wait, device)
        t1 = time.perf_counter()
        changed = self.scheduler.postprocess(step.plan, results)
        t2 = time.perf_counter()
        self._observe(step.plan, results, device, cost)
        h["collect"] += t1 - t0   # (the device wait included: runner.last_wait)
        h["postprocess"] += t2 - t1
        h["observe"] += time.perf_counter() - t2
        return changed

    def _progressed(self) -> None:
        self.num_stalled_steps = 0
        self.stalled_since = None

    def _observe(self, plan: StepPlan, results: list[StepResult], elapsed: float, cost: float) -> None:
        """Counters, the prefill pacer (fed the step's device span `elapsed`) and the policy
        (fed `cost`: what the step cost the engine's cadence, StepClock)."""
        acc: list[int] = []       # per draft position: requests that drafted it / had it accepted
        drafted: list[int] = []
        for s, res in zip(plan.scheduled, results):
            if s.draft is not None and not res.discarded:
                self.spec_stats.record(res.tree_depth, res.tree_nodes, res.num_accepted)
                if len(drafted) < res.tree_depth:
                    grow = [0] * (res.tree_depth - len(drafted))
                    drafted += grow
                    acc += grow
                for d in range(res.tree_depth):
                    drafted[d] += 1
                for d in range(res.num_accepted):
                    acc[d] += 1
        draft_len = plan.draft_len
        self.last_draft_len = draft_len
        self.counters["spec_steps" if draft_len else "nonspec_steps"] += 1
        self.draft_len_histogram[draft_len] += 1
        self.counters["num_steps"] += 1
        prefill = sum(s.num_rows for s in plan.scheduled if s.num_rows > 1)   # catch-up rows too
        self.scheduler.pacer.observe(elapsed, prefill)
        self.policy.observe(StepFeedback(
            batch_size=len(plan.scheduled), num_tokens=plan.num_tokens, draft_len=draft_len, step_time=cost,
            num_prefill_tokens=prefill,
            accepted_per_position=tuple(acc), drafted_per_position=tuple(drafted)))

    def _outputs(self, reqs: list[Request]) -> list[RequestOutput]:
        outs = []
        for req in reqs:
            spelled = self.tokenizer is not None and req.params.detokenize
            if req.is_finished and spelled and req.finish_reason != "stop":
                self.detokenizer.flush(req)
            start = req.num_emitted_reported
            out_ids = req.output_token_ids
            new_ids = out_ids[start:]
            req.num_emitted_reported += len(new_ids)
            self.counters["generation_tokens"] += len(new_ids)
            text = new_text = None
            if spelled:
                # Hold back what could still turn out to be the start of a stop string.
                hold = 0 if req.is_finished or not req.params.stop else max(map(len, req.params.stop)) - 1
                upto = max(req.text_reported, len(req.text) - hold)
                new_text = req.text[req.text_reported:upto]
                req.text_reported = upto
                text = req.text[:upto]
            outs.append(RequestOutput(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                token_ids=out_ids if self.delta_outputs else list(out_ids), text=text,
                new_token_ids=new_ids, new_text=new_text,
                finished=req.is_finished, finish_reason=req.finish_reason,
                spec=req.spec_stats.as_dict() if req.is_finished else {},
                num_cached_tokens=req.num_cached_tokens, error=req.error,
                queue_time=None if req.first_scheduled is None else req.first_scheduled - req.arrival,
                logprobs=req.logprobs, new_logprobs=req.logprobs[start:] if req.logprobs is not None else None,
                prompt_logprobs=req.prompt_logprobs if req.is_finished or start == 0 else None,
                stop_reason=req.stop_reason if req.is_finished else None))
            if req.is_finished:
                self.requests.pop(req.request_id, None)
                if req.finish_reason in ("stop", "length"):
                    self.counters[f"finished_{req.finish_reason}"] += 1
        return outs

    # ---- observability --------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """False once a tensor-parallel worker failed: the engine cannot step any more (the
        server's AsyncEngine then fails what is in flight and reports the engine dead)."""
        return self.death_cause is None

    @property
    def death_cause(self) -> str | None:
        driver = getattr(self.runner, "driver", None)
        return driver.failure if driver is not None else None

    def close(self) -> None:
        """Stop the workers of a tensor-parallel engine (a no-op for one process); thaw the
        heap so that the engine's cyclic garbage can be collected."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        gc_heap.thaw()

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.kv.num_blocks

    def stats(self) -> dict:
        return {
            **self.spec_stats.as_dict(),
            "spec_steps": self.counters["spec_steps"],
            "nonspec_steps": self.counters["nonspec_steps"],
            "draft_len_histogram": dict(sorted(self.draft_len_histogram.items())),
            "last_draft_len": self.last_draft_len,
            "policy": self.policy.name,
            "policy_state": self.policy.describe(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": self.kv.num_free,
            "num_total_blocks": self.kv.num_blocks,
            "block_size": self.kv.block_size,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.counters["prompt_tokens"],
            "generation_tokens": self.counters["generation_tokens"],
            "prefix_cache_hit_tokens": self.kv.prefix_hit_tokens,
            "num_steps": self.counters["num_steps"],
            "overlapped_steps": self.counters["overlapped_steps"],
            "attention_backend": self.runner.backend.name,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "enable_expert_parallel": self.config.enable_expert_parallel,
            "cuda_graphs": self.runner.graphs.count if self.runner.graphs else 0,
            # the largest step a token graph holds (cuda_graph.py: captured while they pay)
            "cuda_graph_token_rows": max(self.runner.graphs.token_graphs, default=0) if self.runner.graphs else 0,
            "cuda_graph_capture_s": round(self.runner.graphs.capture_seconds, 2) if self.runner.graphs else 0.0,
            "cuda_graph_memory_bytes": self.runner.graphs.memory_bytes if self.runner.graphs else 0,
            "num_stalled_steps": self.num_stalled_steps,
            "launches": dict(sorted(self.runner.launch_counts.items())),
            "pdl": self.runner.pdl,   # programmatic dependent launch, chosen per model (layers/pdl.py)
            "host_ms_per_step": {k: round(1e3 * v / max(1, self.counters["num_steps"]), 4)
                                 for k, v in sorted({**self.host_times,
                                                     "decide": self.scheduler.decide_seconds}.items())},
        }
