"""Speculation off at zero cost (issue 27): a request that may not speculate in a step gets no
draft refresh; when it may again, its draft is caught up from the target's recomputed hidden
states before it drafts. Checked against per-step refresh (every request refreshed every
step, the behaviour before), which the tests restore by patching `Scheduler.may_refresh`."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.engine import runner as runner_mod
from adaspec.engine.scheduler import Scheduler
from adaspec.engine.step_plan import StepPlan
from adaspec.spec_decode.policy import SpeculationPolicy
from helpers import prompts_of_lengths


class Switch(SpeculationPolicy):
    """Wraps a policy; says 0 while `off` is set (a test's stand-in for high load); with
    `fresh`, it keeps the draft fresh while it says 0."""
    name = "switch"

    def __init__(self, inner, fresh=False):
        super().__init__(inner.cfg)
        self.inner, self.off, self.fresh = inner, False, fresh

    def keeps_draft_fresh(self, batch_size):
        return self.fresh

    def decide(self, batch_size, catchup_tokens=0):
        return None if self.off else self.inner.decide(batch_size)


def per_step_refresh(monkeypatch) -> None:
    """Every request refreshes its draft every step (so none ever falls behind)."""
    monkeypatch.setattr(Scheduler, "may_refresh", lambda self, req, shape: self.draft_sync)


@pytest.fixture(scope="module")
def two_layer_head(agree_dir, tmp_path_factory):
    from adaspec.testing import make_eagle3_head

    return str(make_eagle3_head(tmp_path_factory.mktemp("head2") / "h", agree_dir, num_layers=2, init_std=0.1))


HEADS = {"chain": dict(num_steps=3, topk=1), "tree": dict(num_steps=2, topk=2, num_draft_tokens=4),
         "two-layer": dict(num_steps=2, topk=1)}


def _scenario(agree_dir, head, kw, log):
    """A request `a` opts out (its blocks are cached without draft KV), then `b` extends a's
    prompt (a prefix hit with no valid draft): b runs with speculation off for a while, on,
    is preempted (re-admitted over its own cached blocks), off, on to the end. Returns b's
    tokens, its draft KV over its committed pairs, the engine's stats."""
    llm = LLM(agree_dir, draft=head, speculation="always", device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=12, **kw)
    eng = llm.engine
    pol = eng.scheduler.policy = Switch(eng.policy)
    launch = eng.runner.launch

    def logged(plan):
        log.extend((s.req.request_id, s.refresh, s.catchup, s.num_new_tokens, s.req.pending, str(s.draft), pol.off)
                   for s in plan.scheduled)
        return launch(plan)
    eng.runner.launch = logged
    prompt = prompts_of_lengths([14], seed=61)[0]
    params = dict(temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=6, speculate=False, **params))
    eng.add_request("b", prompt + [5, 9, 7], SamplingParams(max_tokens=40, **params))
    req = eng.requests["b"]
    blocks, preempted = [], False
    while eng.has_unfinished():
        done = len(req.output_token_ids)
        pol.off = done < 8 or 22 <= done < 30
        if done >= 16 and not preempted:
            eng.scheduler._preempt(req, StepPlan())
            preempted = True
        for _ in eng.step():
            pass
        if req.block_ids:
            blocks = list(req.block_ids)
    n, bs = len(req.all_token_ids), 4
    v = min(req.draft_valid_len, n - 1)
    slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(1, v + 1)])
    return req.all_token_ids, eng.runner.draft_kv[:, :, slots].clone(), llm.stats()


@pytest.mark.parametrize("head", HEADS)
def test_catchup_draft_kv_equals_per_step_refresh(agree_dir, trained_head, two_layer_head, head, monkeypatch):
    """Position for position, the draft KV a request has after catch-ups (after an off period,
    a prefix hit on blocks without draft KV, a preemption) is the draft KV per-step refresh
    writes. fp32; not bit-exact because the target re-runs a position in a batch of another
    shape (its sums in another order), so within rounding."""
    path = two_layer_head if head == "two-layer" else trained_head
    log: list = []
    toks, kv, stats = _scenario(agree_dir, path, HEADS[head], log)
    with monkeypatch.context() as m:
        per_step_refresh(m)
        ref_toks, ref_kv, ref_stats = _scenario(agree_dir, path, HEADS[head], [])
    assert toks == ref_toks
    v = min(kv.shape[2], ref_kv.shape[2])   # (the last steps, one token left, refresh nothing)
    assert v >= len(toks) - 3
    torch.testing.assert_close(kv[:, :, :v], ref_kv[:, :, :v], rtol=1e-4, atol=1e-5)
    b = [e for e in log if e[0] == "b"]
    assert [e for e in log if e[0] != "b"] and not any(e[1] for e in log if e[0] != "b")   # a: never refreshed
    catchups = [e for e in b if e[2]]
    assert len(catchups) >= 3, b                       # prefix hit, after the off periods, after preemption
    assert any(e[3] == 0 for e in catchups)            # one did not fit the budget: chunked
    assert any(e[4] for e in catchups) or head == "two-layer"   # planned while the previous step ran
    assert not all(e[1] for e in b)                    # off steps refreshed nothing
    assert stats["num_preemptions"] == 1
    # It drafts again right after each catch-up (a catch-up step itself drafts nothing),
    # where the next step decodes with the policy on.
    assert all(b[k + 1][5] != "None" for k, e in enumerate(b[:-3])
               if e[2] and b[k + 1][2] == 0 and b[k + 1][3] == 1 and not b[k + 1][6]), b
    # Prompt rows refresh the draft while the policy is off (no whole-prompt catch-up later);
    # decode rows do not.
    assert any(e[1] and e[3] > 1 and e[6] for e in b) and not any(e[1] and e[3] == 1 and e[6] for e in b), b
    assert stats["verify_steps"] > 0


def _waves(llm, phases, prompts, params):
    eng, outs, it = llm.engine, {}, iter(prompts)
    for k, c in enumerate(phases):
        for j in range(c):
            eng.add_request(f"w{k}-{j}", next(it), params)
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
    return outs, llm.stats()


def test_threshold_waves_and_auto_lose_no_acceptance(agree_dir, trained_head, monkeypatch):
    """Waves of requests up and down across the threshold, and auto at mixed load with step
    times that make it switch: greedy output equals speculation off, and acceptance equals
    that of per-step refresh within 1%."""
    phases = [1, 6, 2, 6, 1]
    prompts = prompts_of_lengths([4 + (i * 5) % 17 for i in range(sum(phases))], seed=62)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    off, _ = _waves(LLM(agree_dir, device="cpu", dtype="float32", block_size=4), phases, prompts, params)
    configs = {"threshold": dict(speculation="threshold", spec_disable_batch_size=3, num_steps=3),
               "auto": dict(speculation="auto", num_steps=3, auto_profile=False)}
    for name, kw in configs.items():
        acc = {}
        for per_step in (False, True):
            with monkeypatch.context() as m:
                if per_step:
                    per_step_refresh(m)
                llm = LLM(agree_dir, draft=trained_head, device="cpu", dtype="float32", block_size=4, **kw)
                if name == "auto":   # step times of a machine where 3 drafts pay below 3 requests
                    _fake_times(llm.engine, m)
                outs, st = _waves(llm, phases, prompts, params)
            assert outs == off, name
            assert st["spec_steps"] > 0 and st["nonspec_steps"] > 0, (name, st["draft_len_histogram"])
            acc[per_step] = st["accept_length"]
        assert acc[False] > 1.2 and abs(acc[False] - acc[True]) <= 0.01 * acc[True], (name, acc)


def _fake_times(engine, m) -> None:
    """Replace measured step times by a fixed model (drafts cheap while few requests run),
    the cost table seeded with it."""
    pol = engine.policy
    observe = pol.observe

    def t(b, d):
        return 1e-3 * (1 + 0.1 * b * (1 + d) + (0.5 * b * d if b > 2 else 0))

    for b in (1, 2, 4, 8):
        for d in range(pol.max_depth + 1):
            pol._sample((d, pol.bucket(b)), t(b, d))
    m.setattr(pol, "observe", lambda fb: observe(dataclasses.replace(
        fb, step_time=t(fb.batch_size, len(fb.drafted_per_position)))))


def test_resuming_never_stops_the_others_from_decoding():
    """Scheduler alone: 6 requests decode with speculation off for a while (no refresh), then
    it resumes with a budget far below their catch-ups. Every step still schedules every
    request, the catch-ups are chunked and leave a token to each later request, and within
    a few steps every draft is caught up and they draft again."""
    from adaspec.config import SchedulerConfig, SpecConfig
    from adaspec.engine.kv_cache import KVCacheManager
    from adaspec.engine.request import Request
    from adaspec.engine.step_plan import StepResult
    from adaspec.spec_decode.policy import AlwaysPolicy

    pol = Switch(AlwaysPolicy(SpecConfig(draft="x", policy="always", num_steps=2, topk=1)))
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24), KVCacheManager(128, 4), pol, 200,
                      draft_sync=True)
    for i, p in enumerate(prompts_of_lengths([9, 13, 6, 11, 8, 10], seed=63)):
        sched.add(Request(f"r{i}", p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), set()))
    resumed_at, caught_up = None, None
    for step in range(40):
        pol.off = 4 <= step < 12
        plan = sched.schedule()
        assert plan.num_tokens <= 24 and (len(plan.scheduled) == 6 or step < 3), plan
        if step >= 12 and resumed_at is None:
            resumed_at = step
            assert sum(s.catchup for s in plan.scheduled) > 0 and not plan.speculative
            assert any(s.catchup and not s.num_new_tokens for s in plan.scheduled)   # chunked
        if 4 <= step < 12:   # off: no refresh, the drafts fall behind
            assert not any(s.refresh for s in plan.scheduled)
        sched.launched(plan)
        sched.postprocess(plan, [StepResult(emitted=[7] if s.samples else []) for s in plan.scheduled])
        sched.check_invariants()
        if resumed_at and caught_up is None and all(r.draft_valid_len == r.num_computed for r in sched.running):
            caught_up = step
    assert caught_up is not None and caught_up - resumed_at <= 5, (resumed_at, caught_up)
    plan = sched.schedule()
    assert all(s.draft is not None and s.refresh and not s.catchup for s in plan.scheduled)


def test_a_draft_kept_fresh_while_off_resumes_without_a_catch_up(agree_dir, trained_head):
    """A policy that keeps the draft fresh while it says 0 (`keeps_draft_fresh`, auto near its
    break-even): decode rows refresh in the off steps, so switching back on drafts at once,
    with no catch-up step; greedy output equals speculation off, and acceptance that of a
    policy never off (the draft KV is what per-step refresh writes)."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = prompts_of_lengths([11], seed=64)[0]
    off = LLM(agree_dir, device="cpu", dtype="float32", block_size=4).generate([prompt], params)[0].token_ids
    runs = {}
    for flapping in (True, False):
        llm = LLM(agree_dir, draft=trained_head, speculation="always", device="cpu", dtype="float32", block_size=4,
                  num_steps=3, topk=1)
        eng = llm.engine
        pol = eng.scheduler.policy = Switch(eng.policy, fresh=True)
        log = []
        launch = eng.runner.launch

        def logged(plan, launch=launch, log=log, pol=pol):
            log.extend((s.refresh, s.catchup, s.num_new_tokens, s.draft is not None, pol.off) for s in plan.scheduled)
            return launch(plan)
        eng.runner.launch = logged
        eng.add_request("r", prompt, params)
        req, out, k = eng.requests["r"], None, 0
        while eng.has_unfinished():
            pol.off = flapping and (k % 5) in (1, 2)
            k += 1
            for o in eng.step():
                out = o.token_ids if o.finished else out
        assert out == off
        runs[flapping] = (log, llm.stats())
    log, st = runs[True]
    assert not any(e[1] for e in log), log                          # never a catch-up
    off_decodes = [e for e in log if e[4] and e[2] == 1]
    assert off_decodes and all(e[0] and not e[3] for e in off_decodes[:-1]), log   # refreshed, no drafts
    resumed = [log[i + 1] for i, e in enumerate(log[:-2]) if e[4] and not log[i + 1][4] and log[i + 1][2] == 1]
    assert resumed and all(e[3] for e in resumed), log              # drafts right away
    assert st["accept_length"] >= 0.9 * runs[False][1]["accept_length"] > 1.2, (st, runs[False][1])
