"""The scheduler: decides what runs each step and owns every KV reservation and release.

`schedule()` returns a `StepPlan` (printable). Order of business each step:
  1. ask the speculation policy once for the step's draft shape  <- the one decision point
  2. cap it per request (opt-out, max_draft_tokens, tokens left, context left); a request
     whose cap is 0 gets no draft refresh either (nothing of the draft runs for it), and one
     that may speculate but whose draft fell behind is caught up first (below)
  3. reserve exactly the slots the plan needs (decode rows first, then prefill chunks and
     catch-ups of running requests, then new ones), dropping a request's speculation, then
     preempting the newest request, if blocks run out; prefill (catch-ups included) next to
     decode rows is bounded (`_prefill_budget`)
`postprocess()` appends emitted tokens, applies stop conditions, advances `num_computed`
and rolls back the slots of rejected draft tokens.

Speculation off at zero cost, and the catch-up. A request's draft KV covers its pairs
0..draft_valid_len-1. A decode step refreshes it (`ScheduledRequest.refresh`) only when the
request may speculate in it; otherwise the request falls behind. Prompt rows refresh it
whenever the policy may ever speculate (`refreshes_prompts`): one head layer over rows the
target runs anyway, where skipping it would owe a catch-up of the whole prompt, the target
run over it again (at batch 1 `auto` then stayed off after every new request). A policy may
also keep decode rows fresh while it says 0 (`keeps_draft_fresh`: `auto` where speculating is
close to paying, so a flip to 0 and back costs no catch-up). When it may speculate again, the
step first schedules `catchup` rows over positions draft_valid_len.. (chunked within the
token budget, like a prefill): the target runs over them again, writing no target KV (it is
in place), and the draft refresh of those rows writes their draft KV from the recomputed
aux features. The request drafts from the next step on. Recomputing, rather than keeping
each missed position's aux features (k * target_hidden values a token, 24 KiB at an 8B
shape in bf16, six times the draft KV itself) or the head's fc projection of them (which
would keep the fc of every step running), costs no memory; the recomputed features are the
target's at the same position over the same KV, so the draft KV equals what per-step refresh
writes (exactly in exact arithmetic; within rounding where kernels order sums differently
by batch shape). `auto` prices the catch-up (`decide(catchup_tokens=...)`).

Liveness invariant: only running requests hold KV blocks. A waiting request that fails to
reserve gives back the blocks prefix matching attached to it, and a preempted request gives
back all of its own. So whenever nothing runs, the whole pool is free (or evictable) for the
head of the queue, and the oldest running request is never preempted for a newer one: as
long as every single request fits the pool (the engine's max_model_len guarantees it), each
step either computes something or aborts a request that can never fit.
"""
from __future__ import annotations

import time
from collections import deque

from adaspec.config import SchedulerConfig
from adaspec.engine.kv_cache import KVCacheManager
from adaspec.engine.prefill_pacer import PrefillPacer
from adaspec.engine.request import Request, Status
from adaspec.engine.step_plan import ScheduledRequest, StepPlan, StepResult
from adaspec.spec_decode.policy import SpeculationPolicy
from adaspec.spec_decode.tree import DraftShape, request_shape


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, policy: SpeculationPolicy,
                 max_model_len: int, draft_sync: bool, detokenizer=None):
        self.cfg = cfg
        self.kv = kv
        self.policy = policy
        self.max_model_len = max_model_len
        # With a draft head whose KV must stay fresh, every request keeps one extra slot:
        # the draft's pair (hidden_p, token_{p+1}) lives at slot p + 1.
        self.draft_sync = draft_sync
        self.extra_slot = 1 if draft_sync else 0
        self.detokenizer = detokenizer
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.decide_seconds = 0.0   # host time in policy.decide (Engine.stats "host_ms_per_step")
        self.pacer = PrefillPacer(fixed_cap=cfg.long_prefill_token_threshold)   # fed by the engine

    # ---- queue management -----------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        for q in (self.running, self.waiting):
            for r in list(q):
                if r.request_id == request_id:
                    q.remove(r)
                    self._finish(r, "abort")
                    return r
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the plan -------------------------------------------------------------------------
    def draft_budget(self, req: Request, shape: DraftShape | None) -> DraftShape | None:
        """Per-request cap of the policy's shape: opt-out, max_draft_tokens, tokens left."""
        left = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        return request_shape(shape, req.params.speculate, req.params.max_draft_tokens, left)

    def catchup_tokens(self) -> int:
        """Positions the draft would have to catch up on if every running request that may
        speculate did so now (what resuming costs, for policies that price it)."""
        shape = self.policy.configured
        return sum(r.num_computed - r.draft_valid_len for r in self.running
                   if r.draft_valid_len < r.num_computed and self.draft_budget(r, shape) is not None)

    def may_refresh(self, req: Request, shape: DraftShape | None) -> bool:
        """Whether `req` may speculate in a step of `shape` (its draft length is not 0), so
        its draft is refreshed, or first caught up where it fell behind."""
        return self.draft_sync and self.draft_budget(req, shape) is not None

    def _refresh_shape(self, plan: StepPlan, req: Request, prompt: bool, fresh: bool) -> DraftShape | None:
        """The shape deciding whether `req`'s rows refresh the draft: the policy's, else the
        configured one for prompt rows of a policy that may speculate later, and for decode
        rows of an up-to-date draft while the policy keeps drafts fresh (`fresh`, asked once
        per step; module docstring)."""
        if plan.policy_shape is not None:
            return plan.policy_shape
        if self.policy.refreshes_prompts if prompt else (fresh and req.draft_valid_len >= req.num_computed):
            return self.policy.configured
        return None

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.cfg.max_num_batched_tokens
        plan.batch_size = len(self.running) + min(len(self.waiting), max(0, self.cfg.max_num_seqs - len(self.running)))
        t = time.perf_counter()
        if self.draft_sync and self.policy.prices_catchup:
            plan.policy_shape = self.policy.decide(plan.batch_size, catchup_tokens=self.catchup_tokens())
        elif self.draft_sync:
            plan.policy_shape = self.policy.decide(plan.batch_size)
        self.decide_seconds += time.perf_counter() - t
        fresh = plan.policy_shape is None and self.draft_sync and self.policy.keeps_draft_fresh(plan.batch_size)
        # Decode rows first, then prefill chunks: a running stream is never starved by a long
        # prompt (prefill rows get what the decode rows leave, capped by `_prefill_budget`).
        # Among prefills the oldest comes first (it always progresses), then the shortest
        # remaining (a short prompt is not queued behind long ones); see `_prefill_budget`.
        # A catch-up is prefill work (the target over missed positions): charged to the same
        # bound, and it leaves a token of the budget to each request after it.
        age = {id(r): k for k, r in enumerate(self.running)}
        prefills = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        prefills[1:] = sorted(prefills[1:], key=lambda r: r.num_tokens - r.num_computed)
        todo = [r for r in self.running if r.num_tokens - r.num_computed <= 1] + prefills
        prefill = None   # the prefill tokens still allowed in this step (set at the first prefill row)
        i = 0
        while i < len(todo) and budget > 0:
            req = todo[i]
            if req.pending and self._will_finish_by_length(req):
                i += 1          # its last token is in flight; nothing left to compute
                continue
            left = req.num_tokens - req.num_computed
            refresh = self.may_refresh(req, self._refresh_shape(plan, req, left > 1, fresh))
            behind = req.num_computed - req.draft_valid_len if refresh else 0
            if (behind or left > 1) and prefill is None:
                prefill, reserved = self._prefill_budget(plan, budget, reserve_for_new=True)
            catchup = min(behind, prefill, budget - (len(todo) - i - 1)) if behind else 0
            if behind and catchup <= 0:   # no room this step: it runs without its draft
                refresh, behind, catchup = False, 0, 0
            decoding = left == 1 and not behind
            if left > 1 and not catchup and prefill <= 0:
                break
            if catchup < behind:
                num_new = 0           # the catch-up goes on next step
            elif left == 1:
                num_new = 1
            else:
                num_new = min(left, budget - catchup, prefill - catchup)
                if req is prefills[0] and len(prefills) > 1:
                    num_new = min(num_new, max(1, prefill // 2))   # half for the others
            draft = self.draft_budget(req, plan.policy_shape) if decoding and refresh else None
            if draft is not None and num_new + draft.num_nodes > budget:
                draft = draft.capped(0)
            while True:
                # `spec_ahead`: a speculative step still in flight may emit that many tokens
                # more than the one this plan assumes (the runner shifts positions on the device).
                slots = (req.num_computed + num_new + (draft.spec_slots if draft else 0) + self.extra_slot
                         + req.spec_ahead)
                if self.kv.reserve(req, slots):
                    break
                if draft is not None:      # give up speculation before anyone's KV
                    draft = None
                    continue
                # The newest request not yet planned goes back to the queue (this one if it is
                # the newest): the oldest running request is never preempted for a newer one.
                victim = max(todo[i:], key=lambda r: age[id(r)])
                todo.remove(victim)
                self._preempt(victim, plan)
                if victim is req:
                    req = None
                    break
            if req is None:
                continue        # todo[i] is now the next request
            plan.scheduled.append(ScheduledRequest(req, num_new, draft, refresh, catchup))
            req.in_flight += 1
            budget -= catchup + num_new + (draft.num_nodes if draft else 0)
            if not decoding:
                prefill -= catchup + (num_new if left > 1 else 0)
            i += 1
        # New requests, oldest first, while budget, sequence slots and blocks allow.
        prefill = sum(self._prefill_budget(plan, budget, reserve_for_new=False)) if prefill is None else \
            min(budget, prefill + reserved)
        while self.waiting and prefill > 0 and len(self.running) < self.cfg.max_num_seqs and not plan.preempted:
            req = self.waiting[0]
            if req.num_computed == 0 and not req.block_ids:
                if self._twin_prefilling(req, plan):
                    break   # next step it shares the twin's prompt KV through the prefix cache
                self._match_prefix(req)
            refresh = self.may_refresh(req, self._refresh_shape(plan, req, True, fresh))
            behind = req.num_computed - req.draft_valid_len if refresh else 0
            catchup = min(behind, prefill)
            num_new = min(req.num_tokens - req.num_computed, prefill - catchup) if catchup == behind else 0
            if not self.kv.reserve(req, req.num_computed + num_new + self.extra_slot):
                # Give back the prefix-cache blocks just attached: a waiting request that kept
                # them would pin blocks no one can use, and with preempted requests queued in
                # front of it, every waiting request could end up pinning some while nothing
                # runs and nothing fits (a deadlock).
                self._unmatch(req)
                if not self.running:
                    self._check_fits_ever(req)
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            if req.first_scheduled is None:
                req.first_scheduled = time.monotonic()
            self.running.append(req)
            plan.scheduled.append(ScheduledRequest(req, num_new, None, refresh, catchup))
            req.in_flight += 1
            prefill -= catchup + num_new
        return plan

    def _prefill_budget(self, plan: StepPlan, budget: int, reserve_for_new: bool) -> tuple[int, int]:
        """(prefill tokens running requests may still take this step, tokens kept for new ones),
        given the decode rows planned so far. With no decode row the whole budget goes to
        prefill (a burst of prompts starts at full speed); with decode rows the pacer caps it
        (`PrefillPacer`: a step with prefill costs at most about twice a decode-only step, yet
        keeps pace with a large batch). When requests wait and a sequence slot is free, half
        is kept for them (`reserve_for_new`): a short request that arrives behind long prompts
        starts within a step or two instead of behind all of them."""
        decode_tokens = sum(1 + (s.draft.num_nodes if s.draft else 0) for s in plan.scheduled)
        paced = self.pacer.cap(decode_tokens)
        cap = budget if paced is None else min(budget, paced)
        keep = cap // 2 if reserve_for_new and self.waiting and len(self.running) < self.cfg.max_num_seqs else 0
        return cap - keep, keep

    def _twin_prefilling(self, req: Request, plan: StepPlan) -> bool:
        """`req` has the very prompt of a request prefilling in `plan` (the choices of an n > 1
        request, duplicates): it waits, so that it reads that prompt's KV from the prefix
        cache instead of computing it again (blocks are registered when a step is launched)."""
        if not self.kv.enable_prefix_caching or req.num_prompt_tokens <= self.kv.block_size \
                or req.params.prompt_logprobs is not None:
            return False
        return any(s.num_new_tokens > 1 and s.req.prompt_token_ids == req.prompt_token_ids for s in plan.scheduled)

    def _will_finish_by_length(self, req: Request) -> bool:
        return req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len

    def _match_prefix(self, req: Request) -> None:
        # The target KV of the cached blocks is in place; their draft KV only where it was
        # written (`match_prefix` sets draft_valid_len). A request that speculates catches
        # its draft up from there: at least the last cached position, whose hidden state
        # pairs with the first uncached token, is run again (writing no target KV).
        # Prompt logprobs need the logits of every prompt position: computed, not cached.
        cached = self.kv.match_prefix(req) if req.params.prompt_logprobs is None else 0
        req.num_cached_tokens = cached
        req.num_computed = cached

    def _unmatch(self, req: Request) -> None:
        """Undo `_match_prefix` of a request that stays waiting (its blocks stay cached)."""
        self.kv.free_request(req)
        self.kv.prefix_hit_tokens -= req.num_cached_tokens
        req.num_cached_tokens = 0
        req.num_computed = 0
        req.draft_valid_len = 0

    def check_invariants(self) -> None:
        """Assert the block accounting the liveness argument rests on (tests call this)."""
        assert all(not r.block_ids and r.num_computed == 0 for r in self.waiting), \
            f"waiting requests hold KV: {[r for r in self.waiting if r.block_ids]}"
        assert all(0 <= r.draft_valid_len <= r.num_computed for r in self.running), \
            f"draft ahead of the target: {[r for r in self.running if r.draft_valid_len > r.num_computed]}"
        held = [0] * self.kv.num_blocks
        for r in self.running:
            for b in r.block_ids:
                held[b] += 1
        assert held == self.kv.ref_count, "block reference counts differ from the running requests' tables"
        assert self.kv.num_free == sum(1 for c in held if c == 0)

    def _check_fits_ever(self, req: Request) -> None:
        need = self.kv.blocks_for(req.num_computed + min(req.num_tokens - req.num_computed,
                                                         self.cfg.max_num_batched_tokens) + self.extra_slot)
        if need > self.kv.num_blocks:
            self.waiting.remove(req)
            self.kv.free_request(req)
            req.status = Status.FINISHED
            req.finish_reason = "abort"
            req.error = (f"request needs {need} KV blocks but the cache holds {self.kv.num_blocks}")

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        self.kv.free_request(req)
        req.num_computed = 0
        req.draft_valid_len = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)

    # ---- after the step -------------------------------------------------------------------
    def launched(self, plan: StepPlan) -> None:
        """The runner has launched `plan`: its committed tokens count as computed from now on,
        and every sampling request owes one token until `postprocess` (a speculative one may
        emit up to `spec_ahead` more). This is what lets the next step be planned while this
        one runs."""
        for s in plan.scheduled:
            req = s.req
            req.num_computed += s.num_new_tokens
            if s.refresh:   # its accepted drafts are added when the step is applied
                req.draft_valid_len = s.start + s.num_rows
            req.pending += s.samples
            req.spec_ahead = s.draft.num_steps if s.draft is not None else 0
            if s.num_rows > 1:   # prompt blocks become matchable before the step's results
                self.kv.commit(req)

    def postprocess(self, plan: StepPlan, results: list[StepResult]) -> list[Request]:
        """Apply the runner's results of a launched plan; return the requests that changed
        (finished included)."""
        changed = []
        for s, res in zip(plan.scheduled, results):
            req = s.req
            req.pending -= s.samples
            req.in_flight -= 1
            if not req.in_flight:   # else the later step's launch has set its own
                req.spec_ahead = 0
            if req.is_finished:          # aborted (or stopped by an earlier step) meanwhile
                res.discarded = True
                continue
            preempted = req.status == Status.WAITING   # preempted while the step ran: its
            if not preempted:                          # token is valid, its KV is gone
                req.num_computed += res.num_accepted
                if s.refresh:   # the refresh wrote the accepted drafts' pairs too
                    req.draft_valid_len += res.num_accepted
            if s.draft is not None:
                req.spec_stats.record(res.tree_depth, res.tree_nodes, res.num_accepted)
            if res.prompt_logprobs is not None:   # by position: a recomputed prompt rewrites its own
                first, entries = res.prompt_logprobs
                req.prompt_logprobs[first:first + len(entries)] = entries
            reason = None
            for j, tok in enumerate(res.emitted):
                req.append_token(tok)
                if res.logprobs is not None:
                    req.logprobs.append(res.logprobs[j])
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    self._finish(req, reason)
                    break
            if res.emitted:
                if self.detokenizer is not None and not req.params.stop and req.params.detokenize:
                    # A token that stopped the request (eos, a stop id, a complete grammar) is
                    # not spelled (unless include_stop_str_in_output), as in `_stop_reason`.
                    n = len(req.all_token_ids) - req.num_prompt_tokens   # (read back: none pending)
                    spelled = reason != "stop" or req.params.include_stop_str_in_output
                    self.detokenizer.update(req, check_stop=False, upto=n if spelled else n - 1)
                changed.append(req)
            if req.is_finished or preempted:
                continue
            if not req.in_flight:
                # Rollback: keep slots for committed KV (+ the draft's shifted slot) only. A
                # request in a later planned step keeps that step's reservation; it is trimmed
                # when that step is applied.
                self.kv.release_tail(req, req.num_computed + self.extra_slot)
            self.kv.commit(req)
        return changed

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if req.grammar is not None:
            # Every emitted token is one the step's bitmask allowed, so the matcher accepts it;
            # a complete grammar (its stop token accepted) ends the request, ignore_eos or not.
            if not req.grammar.accept(tok):
                req.error = (f"token {tok} breaks the request's grammar: no token was legal (the grammar has no "
                             f"continuation in this model's vocabulary, or allowed_token_ids / bad_words "
                             f"exclude every token it allows)")
                return "abort"
            if req.grammar.done:
                return self._token_stop(req, None)
        n = len(req.all_token_ids)   # tokens read back (a later step may owe more)
        # Before min_tokens no stop applies (stop ids are masked on the device anyway).
        early = n - req.num_prompt_tokens <= p.min_tokens
        if not early and tok in req.eos_token_ids and not p.ignore_eos:
            return self._token_stop(req, None)
        if not early and tok in p.stop_token_ids:
            return self._token_stop(req, tok)   # vLLM's stop_reason: the stop id (None for EOS)
        # Stop strings are looked for token by token (the text is cut at the first); without
        # any, the text is extended once per step (`postprocess`): the same text, fewer calls.
        if p.stop and self.detokenizer is not None and self.detokenizer.update(req, check_stop=not early):
            return "stop"  # a stop string completed; the detokenizer cut the text
        if n - req.num_prompt_tokens >= p.max_tokens or n >= self.max_model_len:
            return "length"
        return None

    def _token_stop(self, req: Request, stop_id: int | None) -> str:
        """A stop by the newest token: not spelled in the text unless the request includes it
        (requests without stop strings are spelled once per step, in `postprocess`)."""
        req.stop_reason = stop_id
        if req.params.stop and req.params.include_stop_str_in_output and self.detokenizer is not None:
            self.detokenizer.update(req, check_stop=False)
        return "stop"

    def _finish(self, req: Request, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:   # preempted while its last step ran
            self.waiting.remove(req)
        self.kv.free_request(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
