"""Long prompts next to running streams: decode rows are always planned, a step's prefill is
bounded while anything decodes, and a short prompt is not queued behind long ones. The real
`Engine.step` drives a fake runner whose step time the test sets (a linear cost model), so
the pacer's measured cap is exercised without timing anything."""
from __future__ import annotations

import random

import pytest

from adaspec.config import EngineConfig
from adaspec.engine.engine import Engine
from adaspec.engine.prefill_pacer import PrefillPacer
from adaspec.sampling import SamplingParams

from fake_runner import FakeRunner

DECODE_S, TOKEN_S = 0.010, 0.0005     # the fake device: 10 ms per step + 0.5 ms per prefill token


def _linear(prefill: int) -> float:
    return DECODE_S + TOKEN_S * prefill


def _engine(threshold: int, overlap: bool, plans: list, cost=_linear) -> Engine:
    cfg = EngineConfig.create("fake-model", max_num_seqs=32, max_num_batched_tokens=8192, block_size=16,
                              num_blocks=4000, long_prefill_token_threshold=threshold, overlap=overlap)

    def on_launch(plan, in_flight):
        plans.append([(s.req.request_id, s.num_new_tokens) for s in plan.scheduled])
        prefill = sum(n for _, n in plans[-1] if n > 1)
        return cost(prefill)   # this step's time, when it is collected

    runner = FakeRunner(4000, random.Random(0), False, on_launch)
    runner.model_spec.max_position = 4096
    runner.model_spec.vocab_size = 50
    return Engine(cfg, runner=runner)


def test_pacer_cap_formula():
    p = PrefillPacer(itl_ratio=2.0, per_decode=4, min_chunk=16, default_cap=256)
    assert p.cap(0) is None                        # nothing decodes: the whole budget
    assert p.cap(3) == 256                         # no measurements yet
    p.observe(0.010, 0)
    p.observe(0.010 + 100 * 0.0005, 100)
    assert p.cap(1) == pytest.approx(20, abs=1)    # (2 - 1) * 10 ms / 0.5 ms
    assert p.cap(50) == 200                        # at least 4 per decode token
    p.observe(0.5, 100)                            # very slow prefill: never below min_chunk
    p.observe(0.5, 100)
    assert p.cap(1) == 16
    assert PrefillPacer(fixed_cap=64, per_decode=4).cap(1) == 64 and PrefillPacer(fixed_cap=64, per_decode=4).cap(100) == 400
    assert PrefillPacer().cap(100) == 1600   # the default floor: 16 per decode token


def test_pacer_earns_a_fixed_prefill_cost():
    """Prefill that costs 20 ms per step whatever its size, plus 0.05 ms a token (a mixture
    of experts: a few rows read most experts): no chunk keeps a 10 ms step under 18 ms, so the
    chunk is the one whose tokens cost what the fixed part does (400), reached by doubling past
    the largest chunk measured; a linear device keeps the latency-bound chunk."""
    p = PrefillPacer(itl_ratio=1.8, per_decode=4, min_chunk=4, default_cap=32)
    p.observe(0.010, 0)
    for n in (32, 64):
        p.observe(0.010 + 0.020 + 0.00005 * n, n)
    assert p.fit() == pytest.approx((0.020, 0.00005))
    assert p.cap(1) == 128                          # 2x the largest chunk measured, not 400 yet
    for n in (128, 256):
        p.observe(0.010 + 0.020 + 0.00005 * n, n)
    assert p.cap(1) == 400 and p.cap(200) == 800    # fixed / per token; the floor still holds
    lin = PrefillPacer(itl_ratio=1.8, per_decode=4, min_chunk=4)
    lin.observe(0.010, 0)
    for n in (32, 64, 128):
        lin.observe(0.010 + 0.0005 * n, n)
    assert lin.fit() == pytest.approx((0.0, 0.0005)) and lin.cap(1) == 16   # 8 ms / 0.5 ms
    flat = PrefillPacer(per_decode=4)
    flat.observe(0.010, 0)
    flat.observe(0.030, 64)
    flat.observe(0.030, 256)                        # no cost per token measured: 2x the largest
    assert flat.cap(1) == 512


def test_fixed_prefill_cost_prefills_in_chunks_that_earn_it():
    """The engine with a device whose prefill costs 20 ms per step plus 0.05 ms a token: 8
    prompts of 2,000 tokens next to a running stream are prefilled in chunks that grow to
    hundreds of tokens, not in the 16-token floor a per-token price gives (0.8 x 10 ms over
    ~0.7 ms a token at 32 tokens), so they take a fraction of the device time."""
    plans: list = []
    eng = _engine(0, False, plans, cost=lambda n: DECODE_S + (0.020 + 0.00005 * n if n else 0.0))
    g = dict(temperature=0.0, ignore_eos=True)
    eng.add_request("light", [3 + i % 40 for i in range(16)], SamplingParams(max_tokens=400, **g))
    for _ in range(10):
        eng.step()
    for k in range(8):
        eng.add_request(f"long{k}", [3 + (k + i) % 40 for i in range(2000)], SamplingParams(max_tokens=2, **g))
    sched = eng.scheduler
    steps = 0
    while any(r.request_id.startswith("long") and r.num_computed < r.num_prompt_tokens
              for r in [*sched.running, *sched.waiting]) and steps < 2000:
        eng.step()
        steps += 1
    chunks = [sum(n for r, n in p if r.startswith("long") and n > 1) for p in plans[10:10 + steps]]
    assert max(chunks) >= 400 and steps <= 50, (steps, chunks[:20])
    assert all(("light", 1) in p for p in plans[10:10 + steps])   # the stream decodes throughout


@pytest.mark.parametrize("overlap", [False, True])
def test_long_prompts_do_not_stall_a_stream_or_a_short_request(overlap):
    results = {}
    for name, threshold in (("paced", 0), ("unpaced", 8192)):
        plans: list = []
        eng = _engine(threshold, overlap, plans)
        g = dict(temperature=0.0, ignore_eos=True)
        eng.add_request("light", [3 + i % 40 for i in range(16)], SamplingParams(max_tokens=120, **g))
        step, arrival = 0, None
        while eng.has_unfinished():
            if step == 10:
                for k in range(8):
                    eng.add_request(f"long{k}", [3 + (k + i) % 40 for i in range(2000)], SamplingParams(max_tokens=4, **g))
            if step == 14:
                eng.add_request("short", [3 + i % 7 for i in range(24)], SamplingParams(max_tokens=2, **g))
                arrival = len(plans)
            eng.step()
            step += 1
        light_steps = [p for p in plans if ("light", 1) in p]
        assert len(light_steps) >= 119               # the stream decodes in every step it is in
        cost = [DECODE_S + TOKEN_S * sum(n for _, n in p if n > 1) for p in plans]
        with_light = [c for c, p in zip(cost, plans) if any(r == "light" for r, _ in p)]
        done, k = 0, arrival                          # the (fake) time until the short prompt is prefilled
        while done < 24:
            done += sum(n for r, n in plans[k] if r == "short")
            k += 1
        long_left = 16000 - sum(n for p in plans[:k] for r, n in p if r.startswith("long") and n > 1)
        results[name] = (max(with_light) / DECODE_S, sum(cost[arrival:k]), long_left)
    worst_paced, ttft_paced, long_left = results["paced"]
    worst_unpaced = results["unpaced"][0]
    # Unpaced, one step carries ~8000 prefill tokens next to the stream (a 400x step);
    # paced, the stream's steps stay within 1.8x of a decode-only step once measured (the first steps
    # run before the pacer has measured anything: the default cap of 256 tokens).
    assert worst_unpaced > 300
    assert worst_paced <= 1 + TOKEN_S * 256 / DECODE_S + 1e-9
    late = [sum(n for _, n in p if n > 1) for p in plans[40:] if any(r == "light" for r, _ in p)]
    assert late and max(late) <= 21                # measured: (1.8 - 1) * 10 ms / 0.5 ms = 16, plus slack
    # The short prompt is not queued behind the long ones: it is prefilled within a few paced
    # steps while most of the 16000 long-prompt tokens are still to come.
    assert ttft_paced < 0.5 and long_left > 12000


def test_offline_llm_prefills_at_the_whole_budget_unless_asked(llama_dir):
    """LLM (offline) is throughput-first: next to decode rows a prompt takes the step's whole
    budget; an explicit threshold (0: paced by measurement) is kept, and paces."""
    from adaspec import LLM, SamplingParams

    def second_step(**kw) -> list[int]:
        llm = LLM(llama_dir, device="cpu", dtype="float32", max_num_batched_tokens=64, **kw)
        eng = llm.engine
        eng.add_request("a", [3, 4, 5], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        eng.step(), eng.step()                               # "a" decodes
        eng.add_request("b", list(range(3, 103)), SamplingParams(max_tokens=2, temperature=0.0))
        return llm.engine.config.scheduler.long_prefill_token_threshold, \
            [s.num_new_tokens for s in eng.scheduler.schedule().scheduled]

    assert second_step() == (64, [1, 63])                              # unpaced: 63 of the 64
    threshold, rows = second_step(long_prefill_token_threshold=0)
    assert threshold == 0 and rows[0] == 1 and rows[1] < 63           # paced
