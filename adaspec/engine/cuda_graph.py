"""CUDA graphs of the drafters (K greedy chain steps; tree drafting with selection, per tree
shape) and of the target forward: for uniform batches (every request has the same number of
query rows q: decode (q = 1) and verification (q = k + 1 for chains, N for trees), at
batch-size buckets up to `max_num_seqs`), and for any mix of requests ("token graphs": prompt
chunks beside decodes, chains and trees, at token-count buckets); after each uniform
target graph, a post graph per draft depth (LM head on the verify rows, greedy or simulated
verification, tree-KV move, draft refresh; decode graphs also without the refresh, for steps
in which no request may speculate), each plain, with logprobs, and with a grammar's bitmask.
One memory pool is shared by all graphs (uniform ones captured largest first). A batch between
buckets is padded with requests that have no keys and write no KV (their blocks map to the
runner's scratch block).

A token graph of R rows takes any step of at most R rows (`ForwardInputs.pad_to`): a padding
request owns the rows past the step's (they see no key, write no KV), requests of no rows fill
fixed request slots, the attention launch plan has a fixed number of programs and tree masks a
fixed room (`FixedLaunch`); its post-forward runs eagerly. Eagerly, a step is host time: the
demo pair's prompt step took 7-10 ms on the H200 for 0.2 ms of device work, the 48 layers of
the Qwen3-30B-A3B shape ~58 ms. Where the device bounds a forward, padding costs more than the
launches: token graphs are captured from the smallest bucket up while a replay beats what the
eager forward of the bucket below costs a served step (`graph_sizes.pays`). Larger steps, and
the post-forward of steps that are not uniform or that sample or penalize, run eagerly.

Capture stages its dummy batches with the step's own layout functions (`step_layout`,
`verify_step`, `draft_step`) into the step's own staging buffers: the target forward's
metadata is always the first thing staged in a step and the post inputs come right after
it, so a replayed graph reads the same addresses the step just filled.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from adaspec.device.chain_steps import ChainSteps
from adaspec.device.staging import FixedLaunch, max_programs
from adaspec.device.shift import Shift
from adaspec.engine.draft_refresh import refresh_entries
from adaspec.engine.graph_sizes import MAX_GRAPH_TOKENS, batch_buckets, pays, token_buckets, token_graph_margin_s
from adaspec.engine.step_layout import ForwardInputs, StepLayout, stage_forward_inputs
from adaspec.engine.verify_step import stage_verify, verify_inputs
from adaspec.layers.attention import ForwardContext, forward_context
from adaspec.spec_decode.drafter import Trees
from adaspec.spec_decode.policy import SpeculationPolicy

log = logging.getLogger("adaspec")


def record(fn, pool=None):
    """(graph, output) of `fn` captured in a CUDA graph (into `pool` if given), after one
    warm-up run on a side stream (allocator and kernel caches settle outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out


class _Graph:
    """A captured target forward up to the final hidden states. The LM head runs outside,
    on the rows that sample only: vocabulary-wide logits as a graph output would be a
    static [b*q, vocab] tensor per graph (hundreds of MB each at an 8B shape's buckets).
    A uniform graph holds `batch` requests of `q` rows; a token graph (`launch`: the fixed shape
    of its attention metadata) holds `q` rows in `batch` request slots, trees or not."""

    def __init__(self, batch: int, q: int, tree: bool, graph, hidden, aux, launch: FixedLaunch | None = None,
                 eager=None):
        self.batch, self.q, self.tree, self.graph, self.hidden, self.aux = batch, q, tree, graph, hidden, aux
        self.launch, self.eager = launch, eager   # (eager: the captured forward, run without the graph)

    def fit(self, fi: ForwardInputs) -> None:
        """Pad a step's forward inputs to this graph's shape."""
        if self.launch is None:
            fi.pad(self.batch - len(fi.q_lens), self.q, self.tree)
        else:
            fi.pad_to(self.q, self.batch)

    def replay(self):
        self.graph.replay()
        return self.hidden, self.aux


class _PostGraph:
    """Everything after a target graph (`verify_step.PostForward`: LM head on the verify rows,
    greedy or simulated verification, tree-KV move, draft refresh) for its batch and shape;
    reads the target graph's outputs and the step's post inputs staged right after the
    forward's metadata (a grammar variant also the bitmask buffer, `GrammarMasks.dev`);
    returns the static output rows and logprob rows (None but in a logprobs variant)."""

    def __init__(self, graph, out, lp):
        self.graph, self.out, self.lp = graph, out, lp

    def replay(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.graph.replay()
        return self.out, self.lp


class _DraftGraph:
    """K chain draft steps for `batch` rows (`ChainDrafter.propose`): their metadata and
    inputs derived inside the graph from the loaded inputs (`ChainSteps.load`), the drafts
    scattered into the step; static drafts [batch, K]."""

    def __init__(self, batch: int, graph, out):
        self.batch, self.graph, self.out = batch, graph, out

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class _TreeGraph:
    """Tree drafting for `batch` requests of one tree shape: static inputs (hidden, root
    token), static `Trees`; its metadata is staged by `TreeDrafter.stage` with `pad_to`."""

    def __init__(self, batch: int, graph, h0, root0, out):
        self.batch, self.graph, self.h0, self.root0, self.out = batch, graph, h0, root0, out

    def run(self, h: torch.Tensor, root: torch.Tensor):
        n = h.shape[0]
        self.h0[:n].copy_(h)
        self.root0[:n].copy_(root)
        self.graph.replay()
        o = self.out
        return Trees(o.tokens[:n], o.parents[:n], o.depths[:n], o.mask[:n], o.depth[:n])


@dataclass(frozen=True)
class GraphInputs:
    """What the graphs capture, named: the models, the device state they read and write, the
    step's staging buffers and the pieces of a step that run inside graphs."""

    spec: object             # SpecConfig
    max_num_seqs: int
    max_model_len: int
    max_token_rows: int      # token graphs up to the first bucket holding this many rows (0: none)
    model: object            # the target (forward up to the final hidden states)
    backend: object
    kv_caches: list
    group: int               # target query heads per KV head
    block_size: int
    block_table: torch.Tensor
    pad_row: int             # device row of padding requests (its blocks map to scratch)
    stg: object              # the step's staging buffer
    draft_stg: object        # the drafters' staging buffer
    post: object             # verify_step.PostForward
    grammar_masks: object = None   # grammar_step.GrammarMasks (its device buffer), None: no grammar graphs
    chain: object = None     # draft_step.ChainDrafter (None without a draft head)
    trees: object = None     # spec_decode.drafter.TreeDrafter
    draft_cache: list | None = None
    draft_hidden_size: int = 0
    draft_layers: int = 0
    dtype: torch.dtype = torch.float32
    device: torch.device | None = None
    tp: object = None        # this rank's TPGroup (its ranks must capture the same graphs), or None


class CudaGraphs:
    def __init__(self, g: GraphInputs):
        self.g = g
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.token_graphs: dict[int, _Graph] = {}   # rows -> token graph
        self.draft_graphs: dict[tuple[int, int], _DraftGraph] = {}
        self.tree_graphs: dict[tuple[int, int, int], _TreeGraph] = {}   # (batch, num_steps, N)
        # (batch, q, tree, depth, verification, refresh, extra): see post_shapes
        self.post_graphs: dict[tuple, _PostGraph] = {}
        self.pool = None
        self._h0 = self._tok0 = None
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def tables(self) -> dict[str, dict]:
        """Every kind's captured graphs by table name (counted; named across ranks: step_program)."""
        return {t: getattr(self, t) for t in ("graphs", "token_graphs", "post_graphs", "draft_graphs", "tree_graphs")}

    @property
    def count(self) -> int:
        return sum(map(len, self.tables().values()))   # every kind: the start-up log and the stats

    def shapes(self) -> list[tuple[int, bool]]:
        """(q, tree) pairs the policies can ask for: decode, every chain length up to the
        configured one, and the configured tree."""
        out = [(1, False)]
        if self.g.chain is not None:
            spc = self.g.spec
            if spc.topk == 1:
                out += [(k + 1, False) for k in range(1, spc.num_steps + 1)]
            else:
                out += [(spc.resolved_num_draft_tokens, True)]
                # auto may fall back to chains of the same depth budget
                out += [(k + 1, False) for k in range(1, spc.num_steps + 1)]
        return out

    def capture_all(self) -> None:
        # The cyclic garbage of engines that came before (their CUDA graphs, events, pinned
        # buffers) goes now: freed by an automatic collection in the middle of a capture, it
        # would invalidate the capture (seen on the H200 in a test that builds many engines).
        gc.collect()
        gc.disable()
        try:
            self._capture_all()
        finally:
            gc.enable()

    def _capture_all(self) -> None:
        g = self.g
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()   # capture empties the cache too: measure from the same floor
        reserved0 = torch.cuda.memory_reserved()
        self.pool = torch.cuda.graph_pool_handle()
        buckets = batch_buckets(g.max_num_seqs)
        todo = [(b, q, tree) for q, tree in self.shapes() for b in buckets if b * q <= MAX_GRAPH_TOKENS]
        for b, q, tree in sorted(todo, key=lambda x: -x[0] * x[1]):
            self.graphs[(b, q, tree)] = self._capture(b, q, tree)
        self._capture_token_graphs()
        for (b, q, tree), tg in sorted(self.graphs.items(), key=lambda x: -x[0][0] * x[0][1]):
            for depth, kind, refresh in self.post_shapes(q, tree):
                for extra in self.post_extras():
                    self.post_graphs[(b, q, tree, depth, kind, refresh, extra)] = self._capture_post(
                        tg, tree, depth, kind, refresh, extra)
        if g.chain is not None:  # chain drafting: every depth the policies may pick
            for k in range(g.spec.num_steps, 0, -1):
                for b in reversed(buckets):
                    self.draft_graphs[(b, k)] = self._capture_draft(b, k)
            for shape in self.tree_shapes():   # tree drafting: the configured tree and its caps
                for b in reversed(buckets):
                    self.tree_graphs[(b, shape.num_steps, shape.num_draft_tokens)] = self._capture_tree(b, shape)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.memory_bytes = torch.cuda.memory_reserved() - reserved0  # the graphs' pool
        log.info("captured %d CUDA graphs in %.1f s, %.2f GiB; token graphs up to %d rows",
                 self.count, self.capture_seconds, self.memory_bytes / 2**30, max(self.token_graphs, default=0))

    @torch.inference_mode()
    def _capture_token_graphs(self) -> None:
        """Token graphs from the smallest bucket up, while each `pays` (every rank agreeing)."""
        eager_below = launch_below = None
        for rows in token_buckets(self.g.max_token_rows):
            tg = self._capture_tokens(rows)
            replay_s, eager_s, launch_s = self._time_token_graph(tg)
            if eager_below is None:   # (the smallest bucket: against its own eager forward)
                eager_below, launch_below = eager_s, launch_s
            margin_s = token_graph_margin_s(eager_below, launch_below)
            keep = pays(replay_s, eager_below, margin_s)
            if self.g.tp is not None:   # every rank's vote: all must keep it (the start-up exchange)
                keep = all(self.g.tp.exchange(keep))
            if not keep:
                log.info("token graphs stop below %d rows: a replay took %.2f ms, the eager forward of "
                         "fewer rows %.2f ms (margin %.2f ms)", rows, replay_s * 1e3, eager_below * 1e3,
                         margin_s * 1e3)
                break
            self.token_graphs[rows] = tg
            eager_below, launch_below = eager_s, launch_s
        torch.cuda.empty_cache()   # (what the eager forwards cached)

    @staticmethod
    def _time_token_graph(tg: _Graph) -> tuple[float, float, float]:
        """(seconds of a replay, of the same forward run eagerly, of that eager forward's host
        time until its launches return): the fastest of two each."""
        def clock(fn) -> tuple[float, float]:
            t = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t.append((time.perf_counter() - t0, t1 - t0))
            return min(x[0] for x in t), min(x[1] for x in t)
        return clock(tg.graph.replay)[0], *clock(tg.eager)

    def bucket(self, B: int) -> int | None:
        """The captured batch size that holds B requests (None: above every bucket)."""
        return next((b for b in batch_buckets(self.g.max_num_seqs) if b >= B), None)

    def lookup(self, q_lens: list[int], tree: bool) -> _Graph | None:
        """The target graph of a step whose requests have `q_lens` rows each: the uniform
        batch's, else the token graph of the fewest rows that hold the step's (the caller pads
        the step to the graph's shape: `_Graph.fit`)."""
        if not q_lens:
            return None
        g = None
        if all(q == q_lens[0] for q in q_lens):
            g = self.graphs.get((self.bucket(len(q_lens)), q_lens[0], tree))
        if g is None:
            rows = sum(q_lens)
            g = next((tg for r, tg in self.token_graphs.items() if r >= rows), None)
        return g

    def token_slots(self) -> int:
        """Request slots of a token graph: every running request, the padding request that owns
        the rows past the step's, and one of no rows that owns the padding programs."""
        return self.g.max_num_seqs + 2

    def tree_shapes(self) -> list:
        """Tree shapes a step may draft: the configured one capped at each depth (a step's
        shape is that of its deepest request, and caps keep the topk)."""
        spc = self.g.spec
        if spc.topk == 1:
            return []
        full = SpeculationPolicy.configured_shape(spc)
        return sorted({full.capped(d) for d in range(1, spc.num_steps + 1)}, reverse=True)

    def post_shapes(self, q: int, tree: bool) -> list[tuple[int, str, bool]]:
        """(depth, verification, refresh) a post graph is captured for, after a target graph
        of q rows per request: decode (depth 0), a chain of q-1, or each tree shape of q nodes;
        greedy, or simulated acceptance when the engine simulates it; with the draft refresh,
        and for decode also without it (a step in which no request may speculate). Draft
        heads of more than one layer refresh with a forward of their own: only the latter."""
        draft = self.g.chain is not None
        if q == 1:
            return [(0, "greedy", False)] + ([(0, "greedy", True)] if draft and self.g.draft_layers == 1 else [])
        if draft and self.g.draft_layers > 1:
            return []
        kind = "sim" if self.g.spec.simulate_accept_rate is not None else "greedy"
        if not tree:
            return [(q - 1, kind, True)]
        return sorted({(s.num_steps, kind, True) for s in self.tree_shapes() if s.num_draft_tokens == q})

    def post_extras(self) -> list[str | None]:
        """What a post graph adds to plain verification: nothing, the logprobs of every row
        (MAX_LOGPROBS alternatives; the host keeps the rows and alternatives asked for), or a
        grammar's bitmask on every row (from `GrammarMasks.dev`, all bits set on rows without
        a grammar). A step that needs both, penalties or sampled rows runs its post eagerly."""
        return [None, "logprobs"] + (["grammar"] if self.g.grammar_masks is not None else [])

    def post_graph(self, target: _Graph, depth: int, kind: str, refresh: bool,
                   extra: str | None = None) -> _PostGraph | None:
        return self.post_graphs.get((target.batch, target.q, target.tree, depth, kind, refresh, extra))

    def tree_graph(self, B: int, S: int, N: int) -> _TreeGraph | None:
        return self.tree_graphs.get((self.bucket(B), S, N))

    def draft_graph(self, B: int, K: int) -> _DraftGraph | None:
        return self.draft_graphs.get((self.bucket(B), K))

    def _record(self, fn):
        """(graph, output) of `fn` captured into the shared pool."""
        return record(fn, self.pool)

    def _draft_inputs(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Static inputs of the tree graphs (a hidden state and a token per request), shared by
        all of them: each replay fills its rows first. (Chain graphs derive theirs:
        device.chain_steps.)"""
        if self._h0 is None:
            g = self.g
            self._h0 = torch.zeros(g.max_num_seqs, g.draft_hidden_size, dtype=g.dtype, device=g.device)
            self._tok0 = torch.zeros(g.max_num_seqs, dtype=torch.int64, device=g.device)
        return self._h0[:b], self._tok0[:b]

    @torch.inference_mode()
    def _capture_draft(self, b: int, k: int) -> _DraftGraph:
        g = self.g
        # b padding requests, loaded as `ChainDrafter.run` loads a step's chains
        g.stg.begin()
        inputs, packed = ChainSteps.stage_padding(g.stg, b, k, g.pad_row, Shift(g.stg))   # (an empty shift)
        g.stg.commit()
        g.chain.steps.load(inputs, packed)
        graph, out = self._record(lambda: g.chain.propose(k, b, g.max_model_len, shift=True))   # split-KV: the longest
        return _DraftGraph(b, graph, out)

    @torch.inference_mode()
    def _capture_tree(self, b: int, shape) -> _TreeGraph:
        g = self.g
        staged = g.trees.stage_arrays(g.draft_stg, shape.topk, shape.num_steps, shape.num_draft_tokens, ns=[2] * b,
                                      own_steps=[shape.num_steps] * b, own_nodes=[shape.num_draft_tokens - 1] * b,
                                      rows=[g.pad_row] * b, blocks=[None] * b, block_table=g.block_table,
                                      slack=g.max_model_len)   # kernels size split-KV for the longest context
        h0, root0 = self._draft_inputs(b)
        graph, out = self._record(lambda: g.trees.propose(staged, h0, root0, g.draft_cache))
        return _TreeGraph(b, graph, self._h0, self._tok0, out)

    def _stage_dummy(self, b: int, q: int, tree: bool, launch: FixedLaunch | None = None):
        """The target forward of b padding requests of q rows (with `launch`: a token graph's
        b slots and q rows), staged as a step stages its own."""
        g = self.g
        g.stg.begin()
        if launch is None:
            fi = ForwardInputs.padding(b, q, tree)
        else:
            fi = ForwardInputs()
            fi.pad_to(q, b)
        return stage_forward_inputs(g.stg, g.backend, g.block_table, g.block_size, g.group, fi, tree,
                                    [g.pad_row] * b, max_ctx_len=g.max_model_len,   # split-KV: the longest context
                                    launch=launch)

    @torch.inference_mode()
    def _capture_post(self, tg: _Graph, tree: bool, depth: int, kind: str, refresh: bool,
                      extra: str | None) -> _PostGraph:
        g = self.g
        b, N = tg.batch, tg.q
        _, _, pos = self._stage_dummy(b, N, tree)   # the forward's fields first, as in a step
        lay = StepLayout([], N, depth, tree, [], [], [])
        refresh = refresh_entries([], [], depth, b, N, g.pad_row, g.block_size) if refresh else None
        vb = stage_verify(g.stg, verify_inputs(lay, b, g.pad_row, []),
                          np.zeros((b, max(1, N - 1)), bool) if kind == "sim" else None, refresh, N, depth, tree)
        g.stg.commit()
        vb.all_logprobs = extra == "logprobs"
        if extra == "grammar":
            gm = g.grammar_masks
            vb.grammar = (gm.dev[:b * N], gm.vocab_size)
        graph, (out, lp) = self._record(lambda: g.post(tg.hidden, tg.aux, pos, vb))
        return _PostGraph(graph, out, lp)

    @torch.inference_mode()
    def _capture(self, b: int, q: int, tree: bool, launch: FixedLaunch | None = None) -> _Graph:
        g = self.g
        meta, ids, pos = self._stage_dummy(b, q, tree, launch)
        g.stg.commit()

        def run():
            with forward_context(ForwardContext(meta, g.backend, g.kv_caches)):
                return g.model(ids, pos)

        graph, (hidden, aux) = self._record(run)
        return _Graph(b, q, tree, graph, hidden, aux, launch, eager=run)

    def _capture_tokens(self, rows: int) -> _Graph:
        """The token graph of `rows` rows in `token_slots` request slots."""
        g = self.g
        slots = self.token_slots()
        bq = g.backend.block_q(rows, g.group, slots)
        n = g.spec.resolved_num_draft_tokens if g.trees is not None and g.spec.topk > 1 else 1
        hkv = g.kv_caches[0][0].shape[1]
        # every request may verify a tree; the keys split as for these rows alone, over the
        # longest context
        return self._capture(slots, rows, False, FixedLaunch(
            bq, max_programs(rows, slots, bq), g.max_num_seqs * n * n,
            g.backend.graph_splits(rows, bq, g.group, hkv, g.max_model_len, g.device)))
