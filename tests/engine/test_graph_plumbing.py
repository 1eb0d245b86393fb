"""The CUDA-graph plumbing on CPU: capture layouts, batch padding to buckets, static inputs
and outputs of the target, chain-drafter and tree-drafter graphs.

A captured graph replays its kernels on whatever the staging buffer holds at the addresses
it captured, and writes into the tensors the capture returned. Here a stand-in "graph"
re-runs the captured function with the captured metadata objects and copies its results
into those same tensors: a step whose staging layout differs from the capture's, or that
reads an output the graph does not refresh, gives different tokens or different drafts
than the eager path. (On CUDA, tests/gpu runs the real graphs.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.engine import cuda_graph
from helpers import prompts_of_lengths, record_post_graphs


def _copy_into(dst, src) -> None:
    if dst is None:
        return
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _copy_into(getattr(dst, f.name), getattr(src, f.name))
    else:
        for d, s in zip(dst, src):
            _copy_into(d, s)


class _Replay:
    """What a replay does: the captured work again, results written into the captured outputs."""

    def __init__(self, fn, out, log):
        self.fn, self.out, self.log = fn, out, log

    def replay(self) -> None:
        self.log.append(1)
        _copy_into(self.out, self.fn())


SHAPES = {
    "off": {},
    "chain3": dict(speculation="always", num_steps=3, topk=1),
    "tree": dict(speculation="always", num_steps=2, topk=3, num_draft_tokens=7),
    "auto-tree": dict(speculation="auto", num_steps=2, topk=2, num_draft_tokens=5),
    # simulated acceptance: the post graphs' second verification kind
    "chain3-sim": dict(speculation="always", num_steps=3, topk=1, spec_simulate_accept_rate=0.6),
    "tree-sim": dict(speculation="always", num_steps=2, topk=3, num_draft_tokens=7, spec_simulate_accept_rate=0.6),
    # requests that opt out get no draft refresh: every one (the post graphs without the
    # refresh), or some (write-nothing entries in the post graphs' fixed layout)
    "idle": dict(speculation="always", num_steps=3, topk=1),
    "chain3-optout": dict(speculation="always", num_steps=3, topk=1),
    # the post graphs' extras: logprobs of every row, a grammar's bitmask (CudaGraphs.post_extras)
    "off-logprobs": {},
    "chain3-logprobs": dict(speculation="always", num_steps=3, topk=1),
    "chain3-grammar": dict(speculation="always", num_steps=3, topk=1),
    "tree-sim-grammar": dict(speculation="always", num_steps=2, topk=3, num_draft_tokens=7,
                             spec_simulate_accept_rate=0.6),
}
SPECULATE = {"idle": [False] * 5, "chain3-optout": [True, False, True, False, True]}
# A raw vocabulary for the grammar shapes (token i is one character) and a grammar that forbids
# a third of it; two of the five requests follow it, the others do not.
PIECES = [chr(0x4E00 + i) for i in range(320)]
GRAMMAR = "[" + "".join(PIECES[i] for i in range(320) if i % 3) + "]*"


def _extras(shape: str, k: int) -> dict:
    if shape.endswith("-logprobs"):
        return dict(logprobs=2) if k % 2 == 0 else {}
    if shape.endswith("-grammar"):
        from adaspec.structured import StructuredOutput
        return dict(structured=StructuredOutput("regex", GRAMMAR)) if k in (1, 3) else {}
    return {}


@pytest.mark.parametrize("shape", SHAPES)
def test_graph_steps_equal_eager_steps(agree_dir, trained_head, shape, monkeypatch):
    replays: list[int] = []
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)

    def record(self, fn):
        out = fn()
        return _Replay(fn, out, replays), out

    monkeypatch.setattr(cuda_graph.CudaGraphs, "_record", record)
    post_replays: list[int] = []
    post_replay = cuda_graph._PostGraph.replay

    def counted(self):
        post_replays.append(1)
        return post_replay(self)

    monkeypatch.setattr(cuda_graph._PostGraph, "replay", counted)
    graphs_seen = record_post_graphs(monkeypatch)   # (refresh, extra) of every post graph replayed
    kw = SHAPES[shape]
    # 5 requests over buckets 1, 2, 4, 6: padded batches as the requests finish one by one.
    prompts = prompts_of_lengths([6, 11, 3, 9, 14], seed=41)
    spec = SPECULATE.get(shape, [True] * 5)
    if shape.endswith("-grammar"):
        pytest.importorskip("xgrammar")
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, speculate=sp, **_extras(shape, k))
              for k, (n, sp) in enumerate(zip((5, 30, 17, 24, 9), spec))]
    outs, stats, lps = {}, {}, {}
    for graphs in (False, True):
        llm = LLM(agree_dir, device="cpu", dtype="float32", max_num_seqs=6, block_size=4,
                  **(dict(draft=trained_head) if kw else {}), **kw)
        if shape.endswith("-grammar"):
            from adaspec.structured.grammar import GrammarCache
            llm.engine.grammars = GrammarCache.from_vocab(PIECES, stop_token_ids=[1])
        runner = llm.engine.runner
        if graphs:
            runner.graphs = runner.make_graphs()
            runner.graphs.capture_all()
            assert runner.graphs.graphs
            assert bool(runner.graphs.tree_graphs) == (kw.get("topk", 1) > 1)
            replays.clear()
            graphs_seen.clear()
        res = llm.generate(prompts, params)
        outs[graphs] = [o.token_ids for o in res]
        lps[graphs] = [o.logprobs for o in res]
        stats[graphs] = llm.stats()
    assert outs[True] == outs[False]
    refreshed, extras = [r for r, _ in graphs_seen], [e for _, e in graphs_seen]
    for got, ref in zip(lps[True], lps[False]):   # the graphs' logprobs: every row, the asked k kept
        assert (got is None) == (ref is None)
        if ref is not None:
            assert len(got) == len(ref) and all(len(a[1]) == len(b[1]) == 2 for a, b in zip(got, ref))
            assert [a[0] for a in got] == pytest.approx([b[0] for b in ref], abs=1e-5)
            assert [[t for t, _ in a[1]] for a in got] == [[t for t, _ in b[1]] for b in ref]
    if "-" in shape and shape.split("-")[-1] in ("logprobs", "grammar"):
        assert shape.split("-")[-1] in extras   # ... and they ran as post graphs
    if shape.endswith("-grammar"):   # the grammar held on the constrained requests only
        assert all(t % 3 for k in (1, 3) for t in outs[True][k])
        assert any(t % 3 == 0 for k in (0, 2, 4) for t in outs[True][k])
    assert [len(t) for t in outs[True]] == [p.max_tokens for p in params]
    if kw.get("speculation") == "always" and any(spec):   # (auto's choices follow measured step times)
        # The drafts too: the same tokens accepted, step for step.
        assert stats[True]["accepted_tokens"] == stats[False]["accepted_tokens"] > 0
        assert stats[True]["verify_steps"] == stats[False]["verify_steps"]
    if shape == "idle":   # nothing of the draft ran: no post graph with a refresh
        assert stats[True]["verify_steps"] == 0 and refreshed and not any(refreshed)
    if shape == "chain3-optout":
        assert any(refreshed)
    assert len(replays) > 0
    assert len(post_replays) > 0   # verification and commit ran as a post graph
