"""Liveness under KV pressure: as long as every single request fits the pool, the engine
finishes all of them and the pool returns to full.

Regression for a deadlock with prefix caching: a waiting request kept the prefix-cache blocks
attached by a failed admission while preempted requests were queued in front of it, until
every waiting request pinned some blocks, nothing ran and nothing fitted.

Two layers: the scheduler alone with a scripted runner (hundreds of random pools, prompt
mixes, arrival orders, draft shapes and acceptance patterns in a few seconds), then the real
offline engine (tiny Llama, with and without an EAGLE-3 head) on a smaller random set.
"""
from __future__ import annotations

import random

import pytest
import torch

from adaspec.config import SchedulerConfig, SpecConfig
from adaspec.engine.engine import Engine
from adaspec.engine.llm import LLM
from adaspec.engine.kv_cache import KVCacheManager
from adaspec.engine.request import Request
from adaspec.engine.scheduler import Scheduler
from adaspec.engine.step_plan import StepPlan, StepResult
from adaspec.sampling import SamplingParams
from adaspec.spec_decode.policy import make_policy
from adaspec.testing import make_eagle3_head

VOCAB = 300


def _prompt_mix(rng: random.Random, n: int, max_len: int) -> list[list[int]]:
    """Prompts sharing a few prefixes (prefix-cache hits), with short unique tails."""
    bases = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    out = []
    for _ in range(n):
        p = rng.choice(bases) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 4))]
        out.append(p[:max_len])
    return out


def _scripted_results(plan, rng: random.Random) -> list[StepResult]:
    """What a runner could return: random tokens, a random number of accepted draft tokens."""
    results = []
    for s in plan.scheduled:
        if not s.samples:
            results.append(StepResult(emitted=[]))
        elif s.draft is None:
            results.append(StepResult(emitted=[rng.randrange(3, VOCAB)]))
        else:
            acc = rng.randint(0, s.draft.num_steps)
            results.append(StepResult(emitted=[rng.randrange(3, VOCAB) for _ in range(acc + 1)],
                                      num_accepted=acc, tree_depth=s.draft.num_steps,
                                      tree_nodes=s.draft.num_nodes, path=list(range(1, acc + 1))))
    return results


def _drive_scheduler(seed: int) -> int:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    num_blocks = rng.randint(2, 40)
    spec = rng.choice([None, (1, 1), (3, 1), (3, 2)])
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=rng.random() < 0.8)
    cfg = SchedulerConfig(max_num_seqs=rng.choice([2, 4, 256]),
                          max_num_batched_tokens=rng.choice([3, 16, 8192]))
    policy = make_policy(SpecConfig(draft="scripted", policy="always", num_steps=spec[0], topk=spec[1])
                         if spec else SpecConfig())
    draft_sync = spec is not None
    max_model_len = num_blocks * bs - 1        # what Engine allows: every request fits alone
    sched = Scheduler(cfg, kv, policy, max_model_len, draft_sync=draft_sync)
    n = rng.randint(1, 12)
    arrivals = []
    for i, p in enumerate(_prompt_mix(rng, n, max_model_len - 1)):
        max_tokens = rng.randint(1, max_model_len - len(p))
        arrivals.append(Request(str(i), p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), set()))
    finished = 0
    for step in range(20_000):
        for _ in range(rng.choice([0, 0, 1, 3])):
            if arrivals:
                sched.add(arrivals.pop(0))
        if not arrivals and not sched.has_unfinished():
            break
        plan = sched.schedule()
        assert not plan.empty or not sched.has_unfinished() or arrivals, \
            f"seed {seed}: no progress with work pending: {list(sched.waiting)} free={kv.num_free}"
        before = len(sched.running) + len(sched.waiting)
        sched.launched(plan)
        sched.postprocess(plan, _scripted_results(plan, rng))
        finished += before - len(sched.running) - len(sched.waiting)
        sched.check_invariants()
    else:
        raise AssertionError(f"seed {seed}: did not finish within 20000 steps")
    assert finished == n
    assert kv.num_free == num_blocks, f"seed {seed}: {kv.num_free} of {num_blocks} blocks free at the end"
    return finished


def test_scheduler_liveness_random_pools_and_drafts():
    finished = [_drive_scheduler(seed) for seed in range(400)]
    assert all(n > 0 for n in finished)  # each setup ran requests to completion (checked inside)


def test_waiting_request_keeps_no_prefix_blocks_after_a_failed_admission():
    """The exact shape of the deadlock: a prefix-matched head that does not fit yet."""
    kv = KVCacheManager(6, 2)
    sched = Scheduler(SchedulerConfig(), kv, make_policy(SpecConfig()), max_model_len=11, draft_sync=False)
    a = Request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=1, ignore_eos=True), set())
    sched.add(a)
    plan = sched.schedule()
    sched.launched(plan)
    sched.postprocess(plan, [StepResult(emitted=[3])])                 # a finishes; its blocks stay cached
    big = Request("big", [10] * 9, SamplingParams(max_tokens=2, ignore_eos=True), set())
    sched.add(big)
    sched.schedule()                                                  # big runs, holding 5 blocks
    late = Request("late", [5, 6, 7, 8, 9, 4], SamplingParams(max_tokens=1, ignore_eos=True), set())
    sched.add(late)                                                   # matches a's cached blocks
    sched.schedule()
    assert late in sched.waiting and late.block_ids == [] and late.num_computed == 0
    sched.check_invariants()


# ----- the real engine ------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def one_thread():
    """Many tiny steps: intra-op threads only add overhead (and thrash on a shared machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def head_dir(llama_dir, tmp_path_factory):
    return str(make_eagle3_head(tmp_path_factory.mktemp("liveness") / "head", llama_dir))


SPECS = [None, (2, 1), None, (3, 2)]   # speculation: off, chain of 2, off, tree (3 steps, topk 2)
ENGINE_CASES = [(seed, SPECS[seed % len(SPECS)]) for seed in range(16)]


@pytest.mark.parametrize("seed,spec", ENGINE_CASES)
def test_engine_liveness_under_kv_pressure(llama_dir, head_dir, seed, spec):
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    num_blocks = rng.randint(8, 24)
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=num_blocks, block_size=bs,
              max_num_batched_tokens=rng.choice([16, 8192]))
    if spec:
        kw.update(draft=head_dir, speculation="always", num_steps=spec[0], topk=spec[1])
    engine = Engine.from_kwargs(llama_dir, **kw)
    limit = engine.max_model_len
    pending = []
    for i, p in enumerate(_prompt_mix(rng, rng.randint(4, 8), limit - 1)):
        pending.append((str(i), p, SamplingParams(max_tokens=rng.randint(1, min(40, limit - len(p))),
                                                  temperature=rng.choice([0.0, 1.0]), seed=i, ignore_eos=True)))
    n, done = len(pending), {}
    for _ in range(2000):
        for _ in range(rng.choice([0, 1, 3])):
            if pending:
                engine.add_request(*pending.pop(0))
        if not pending and not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_invariants()
    assert len(done) == n, f"{n - len(done)} requests unfinished: {list(engine.scheduler.waiting)}"
    assert all(o.finish_reason == "length" and o.error is None for o in done.values())
    assert engine.num_free_blocks == num_blocks


def test_llm_generate_reports_a_stalled_engine(llama_dir):
    """LLM.generate raises instead of spinning when the engine cannot make progress."""
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=16, block_size=4)
    llm.engine.scheduler.schedule = StepPlan     # a scheduler that never plans anything
    with pytest.raises(RuntimeError, match="no progress"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
