"""The engine freezes the heap it starts with (engine.gc_heap): full collections then walk
only what the steps allocate; closing the engine, or building the next, thaws it."""
from __future__ import annotations

import gc
import weakref

from adaspec import LLM, SamplingParams


class _Node:
    pass


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_engine_freezes_its_heap_and_close_thaws_it(llama_dir):
    before = _cycle()                       # cyclic garbage-to-be that exists at start-up
    held = before()
    llm = LLM(llama_dir, device="cpu", dtype="float32")
    assert gc.get_freeze_count() > 0
    del held
    gc.collect()
    assert before() is not None             # frozen: not walked by the collector
    after = _cycle()                         # the steps' garbage is collected as usual
    gc.collect()
    assert after() is None
    out = llm.generate([[3, 5, 7]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].token_ids) == 4
    llm.close()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None                  # thawed: collected


def test_a_new_engine_thaws_the_heap_of_the_one_before(llama_dir):
    first = LLM(llama_dir, device="cpu", dtype="float32")
    runner = first.engine.runner
    runner.self_ref = runner                 # the runner in a cycle, as CUDA graphs can hold one
    ref = weakref.ref(runner)
    del first, runner
    gc.collect()
    assert ref() is not None                 # frozen with the first engine
    LLM(llama_dir, device="cpu", dtype="float32")
    assert ref() is None                     # the second engine's start-up collected it
