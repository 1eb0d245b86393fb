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
from adaspec.engine import cuda_graph, graph_sizes
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


def _stand_in_capture(monkeypatch) -> list[int]:
    """Capture on CPU: `_record` keeps the function (see `_Replay`); the list counts replays."""
    replays: list[int] = []
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)

    def record(self, fn):
        out = fn()
        return _Replay(fn, out, replays), out

    monkeypatch.setattr(cuda_graph.CudaGraphs, "_record", record)
    # every token graph "pays" (a stand-in replay measures nothing: `graph_sizes.pays`)
    monkeypatch.setattr(cuda_graph.CudaGraphs, "_time_token_graph", staticmethod(lambda tg: (0.0, 1.0, 0.0)))
    return replays


@pytest.mark.parametrize("shape", ["off", "chain3", "chain3-sim"])
def test_one_requests_prompt_replays_a_token_graph(agree_dir, trained_head, shape, monkeypatch):
    """A prompt (or its chunk) of one request runs the token graph of the next bucket, its
    rows padded: the same tokens and drafts as eager steps, prompts of 1 to a bucket's full
    size, chunked ones included. Padding rows must not write KV nor shift what the real rows
    see."""
    _stand_in_capture(monkeypatch)
    kw = SHAPES[shape]
    lengths = [1, 7, 16, 17, 40, 128, 150]
    prompts = prompts_of_lengths(lengths, seed=5)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs, stats, plps = {}, {}, {}
    for graphs in (False, True):
        llm = LLM(agree_dir, device="cpu", dtype="float32", max_num_seqs=4, block_size=4,
                  max_num_batched_tokens=100, **(dict(draft=trained_head) if kw else {}), **kw)
        runner = llm.engine.runner
        if graphs:
            runner.graphs = runner.make_graphs()
            runner.graphs.capture_all()
            assert list(runner.graphs.token_graphs) == cuda_graph.token_buckets(100) == [16, 32, 64, 128]
        outs[graphs] = [llm.generate([p], sp)[0].token_ids for p in prompts]   # one at a time
        # ... and a prompt's log-probabilities, read from the token graph's hidden rows
        lp = llm.generate([prompts[4]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                       prompt_logprobs=2, logprobs=1))[0]
        plps[graphs] = lp.prompt_logprobs   # [None, (logprob, [(token, logprob), ...]), ...]
        stats[graphs] = llm.stats()
    assert outs[True] == outs[False]
    assert all(len(o) == 12 for o in outs[True])
    assert len(plps[True]) == 40 and plps[True][0] is None
    for (lp, top), (lp_ref, top_ref) in zip(plps[True][1:], plps[False][1:]):
        assert lp == pytest.approx(lp_ref, abs=1e-5) and [t for t, _ in top] == [t for t, _ in top_ref]
    st = stats[True]
    # Every step has a graph: the 150-token prompt runs in chunks of 100 and 50 rows (the
    # step's token budget), padded to 128 and 64.
    assert st["launches"].get("target_eager", 0) == 0 and st["launches"]["target_graph"] > 0, st["launches"]
    assert stats[False]["launches"].get("target_graph", 0) == 0
    assert st["num_free_blocks"] == st["num_total_blocks"]
    if kw:
        assert st["accepted_tokens"] == stats[False]["accepted_tokens"] > 0


@pytest.mark.parametrize("shape", ["off", "chain3", "chain3-sim", "tree"])
def test_mixed_steps_replay_token_graphs(agree_dir, trained_head, shape, monkeypatch):
    """Steps that mix prompt chunks with decodes and chain verification (requests arriving
    while others run, chunked prompts, prefix-cache hits, preemption under a small KV cache,
    overlap: positions shifted on the device)
    replay token graphs: the same tokens and accepted drafts as eager steps, no block left
    behind. With trees, a step that mixes prompt rows in runs eagerly (no token graph holds a
    tree mask); its uniform steps still replay."""
    replays = _stand_in_capture(monkeypatch)
    mixed: list[tuple] = []   # (requests, rows) of steps that mixed prompt rows and decodes in a token graph
    lookup = cuda_graph.CudaGraphs.lookup

    def seen(self, q_lens, tree):
        g = lookup(self, q_lens, tree)
        if g is not None and g.launch is not None and len(q_lens) > 1 and len(set(q_lens)) > 1:
            mixed.append((len(q_lens), sum(q_lens)))
        return g

    monkeypatch.setattr(cuda_graph.CudaGraphs, "lookup", seen)
    kw = SHAPES[shape]
    base = prompts_of_lengths([5, 30, 12, 70, 3, 41], seed=11)
    prompts = base + [base[1][:24] + base[4], base[3][:40] + base[0]]   # prefix hits (blocks of 4)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (9, 20, 6, 14, 25, 11, 8, 17)]
    outs, stats = {}, {}
    for graphs in (False, True):
        # (a fixed prefill cap: the pacer's measured one would make the two runs' steps differ)
        llm = LLM(agree_dir, device="cpu", dtype="float32", max_num_seqs=4, block_size=4, max_num_batched_tokens=48,
                  long_prefill_token_threshold=24, num_kv_blocks=30, **(dict(draft=trained_head) if kw else {}),
                  **kw)
        runner = llm.engine.runner
        if graphs:
            runner.graphs = runner.make_graphs()
            runner.graphs.capture_all()
            assert list(runner.graphs.token_graphs) == [16, 32, 64]
            replays.clear()
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        stats[graphs] = llm.stats()
    assert outs[True] == outs[False]
    assert [len(t) for t in outs[True]] == [p.max_tokens for p in params]
    st, ref = stats[True], stats[False]
    assert st["num_preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0 and st["overlapped_steps"] > 0, st
    assert st["num_free_blocks"] == st["num_total_blocks"]
    if kw:
        assert st["accepted_tokens"] == ref["accepted_tokens"] > 0
    assert st["launches"].get("target_eager", 0) == 0, st["launches"]
    assert st["launches"]["target_graph"] == ref["launches"]["target_eager"] and replays
    assert len(mixed) >= 5, mixed


@pytest.mark.parametrize("shape", SHAPES)
def test_graph_steps_equal_eager_steps(agree_dir, trained_head, shape, monkeypatch):
    replays = _stand_in_capture(monkeypatch)
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
        llm = LLM(agree_dir, device="cpu", dtype="float32", max_num_seqs=6, block_size=4, max_num_batched_tokens=64,
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


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe"])
def test_moe_targets_one_requests_prompt_replays_a_token_graph(name, tmp_path, monkeypatch):
    """The token graph of a prompt with a mixture-of-experts target: the padding rows go through
    the router and the experts too (they are rows of the step), so they must neither change
    the real rows' expert outputs nor write KV. Equal tokens and drafts to eager steps, off and
    chain 3 (a random head: greedy output is the target's whatever it accepts), prompts one at a
    time and all at once (prompt chunks beside decodes)."""
    from moe_models import make_moe_model

    from adaspec.testing import make_eagle3_head

    _stand_in_capture(monkeypatch)
    d = str(make_moe_model(tmp_path / name, name))
    head = str(make_eagle3_head(tmp_path / "head", d))
    prompts = prompts_of_lengths([1, 9, 16, 33, 70], seed=7, vocab=300)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for kw in ({}, dict(draft=head, speculation="always", num_steps=3, topk=1)):
        outs, stats = {}, {}
        for graphs in (False, True):
            llm = LLM(d, device="cpu", dtype="float32", max_num_seqs=4, block_size=4, max_num_batched_tokens=64, **kw)
            runner = llm.engine.runner
            if graphs:
                runner.graphs = runner.make_graphs()
                runner.graphs.capture_all()
            outs[graphs] = [llm.generate([p], sp)[0].token_ids for p in prompts] + \
                [o.token_ids for o in llm.generate(prompts, sp)]
            stats[graphs] = llm.stats()
        assert outs[True] == outs[False], kw
        st = stats[True]
        assert st["launches"].get("target_eager", 0) == 0 and st["launches"]["target_graph"] > 0, st["launches"]
        assert st["num_free_blocks"] == st["num_total_blocks"]
        assert st.get("accepted_tokens", 0) == stats[False].get("accepted_tokens", 0)


def test_token_buckets_and_where_capture_stops(agree_dir, monkeypatch):
    """Buckets: 16, 32, 64, then steps of at most an eighth (1,024 past 8,192), up to the first
    holding the step budget. Capture goes up while a replay beats what the eager forward of the
    bucket below costs a served step, max(eager, 2 x its launch time) (`pays`,
    `token_graph_margin_s`): with an eager forward of 40 ms at any size, 5 ms of it launching,
    and replays of 1.5 ms per row, the 16-row graph pays (24 ms) and the 32-row one does not (48
    ms against 40): token graphs stop at 16 rows, and a step of more rows runs eagerly."""
    b = cuda_graph.token_buckets(8192)
    assert b[:5] == [16, 32, 64, 128, 192] and b[-1] == 8192
    assert all(n / m - 1 <= 0.125 for m, n in zip(b, b[1:]) if m >= 512)
    assert cuda_graph.token_buckets(20000)[-2:] == [19456, 20480] and cuda_graph.token_buckets(129)[-1] == 192
    assert cuda_graph.token_buckets(1) == [16] and cuda_graph.token_buckets(0) == []

    _stand_in_capture(monkeypatch)
    launch_s = 0.005
    monkeypatch.setattr(cuda_graph.CudaGraphs, "_time_token_graph",
                        staticmethod(lambda tg: (tg.q * 1.5e-3, 0.040, launch_s)))
    llm = LLM(agree_dir, device="cpu", dtype="float32", max_num_seqs=2, block_size=4, max_num_batched_tokens=256)
    runner = llm.engine.runner

    def captured() -> list[int]:
        runner.graphs = runner.make_graphs()
        runner.graphs.capture_all()
        return list(runner.graphs.token_graphs)

    assert captured() == [16]   # 32 rows: 48 ms against 40 (2 x 5 - 40 < 0: no margin)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(prompts_of_lengths([10, 40], seed=3), sp)
    launches = llm.stats()["launches"]
    assert launches["target_eager"] >= 1 and launches["target_graph"] >= 1, launches

    # 10 of 40 ms launching: the device bounds it, a served step costs the 40 ms (no margin)
    launch_s = 0.010
    assert captured() == [16]
    # a host-bound forward, 30 of its 40 ms launching, costs a served step 60 ms: that keeps the
    # 32-row graph (48 ms), not the 64-row one (96 ms)
    launch_s = 0.030
    assert captured() == [16, 32]
    # ADASPEC_TOKEN_GRAPH_MARGIN_MS replaces that margin: 0 is the bare comparison, 60 ms
    # keeps the 64-row graph (96 < 40 + 60)
    monkeypatch.setenv("ADASPEC_TOKEN_GRAPH_MARGIN_MS", "0")
    assert captured() == [16]
    monkeypatch.setenv("ADASPEC_TOKEN_GRAPH_MARGIN_MS", "60")
    assert captured() == [16, 32, 64]   # 128 rows: 192 ms against 100


@pytest.mark.parametrize("value", ["x", "-1", "nan"])
def test_token_graph_margin_must_be_milliseconds(monkeypatch, value):
    monkeypatch.setenv("ADASPEC_TOKEN_GRAPH_MARGIN_MS", value)
    with pytest.raises(ValueError, match="ADASPEC_TOKEN_GRAPH_MARGIN_MS"):
        graph_sizes.token_graph_margin_s(0.0, 0.0)
    monkeypatch.setenv("ADASPEC_TOKEN_GRAPH_MARGIN_MS", " 2.5 ")
    assert graph_sizes.token_graph_margin_s(0.02, 0.015) == pytest.approx(0.0025)
    monkeypatch.delenv("ADASPEC_TOKEN_GRAPH_MARGIN_MS")
    # unset: 2 x launch - eager, never below 0 (a device-bound forward: the bare comparison)
    assert graph_sizes.token_graph_margin_s(0.02, 0.015) == pytest.approx(0.01)
    assert graph_sizes.token_graph_margin_s(0.02, 0.004) == 0.0 and not graph_sizes.pays(0.02, 0.02)


@pytest.mark.parametrize("limit,graphs", [(0, []), (40, [16, 32, 64])])
def test_cuda_graph_max_tokens_bounds_the_token_graphs(agree_dir, monkeypatch, limit, graphs):
    """--cuda-graph-max-tokens: token graphs up to the first bucket holding that many rows; 0
    turns them off, and steps that no uniform graph holds (prompts) run eagerly, with the same
    tokens."""
    _stand_in_capture(monkeypatch)
    prompts = prompts_of_lengths([30, 9], seed=2)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(agree_dir, device="cpu", dtype="float32", max_num_seqs=2, block_size=4, max_num_batched_tokens=200,
              cuda_graph_max_tokens=limit)
    ref = [o.token_ids for o in llm.generate(prompts, sp)]
    runner = llm.engine.runner
    runner.graphs = runner.make_graphs()
    runner.graphs.capture_all()
    assert list(runner.graphs.token_graphs) == graphs
    assert llm.stats()["cuda_graph_token_rows"] == max(graphs, default=0)
    before = llm.stats()["launches"].get("target_eager", 0)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    eager = llm.stats()["launches"].get("target_eager", 0) - before
    assert (eager > 0) == (limit == 0), eager
