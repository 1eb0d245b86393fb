"""The model runner: executes a StepPlan on the device. It never decides what to run and never
allocates KV; it reads the block tables the scheduler prepared.

One step (`launch` enqueues it, `collect` waits for it):
  1. stage   every input of the step (the target forward first, then the verify batch, the
             draft refresh, block-table updates, draft steps) into one pinned buffer; ONE
             host->device copy                                     (`step_layout`, `device/`)
  2. draft   on the device, no sync: chains (their metadata derived there) and trees write
             the target forward's ids (trees: positions and mask too) (`draft_step`)
  3. target  one forward over prefill chunks, decodes and drafts (a CUDA graph: of the
             uniform batch, or of the step's token count; `cuda_graph`)
  4. verify  the LM head on the verify rows, the target's choices, verification; accepted tree
             KV moved into place, the draft KV refreshed for every request that may speculate
             (`verify_step`, `draft_refresh`; one "post" CUDA graph after a target graph)
  5. read    ONE device->host copy of the emitted tokens, queued; `collect` waits for it

Between `launch` and `collect` the engine plans and launches the next step (overlap): a
request whose last token is still on the device (`Request.pending`) gets it from
`DeviceRows.last_token`, filled on the device before the forward; its positions are shifted
there by what the step in flight emitted (`device/shift.py`; by the chain draft graph itself).

A step has a host half (`_prepare`: step 1, naming the device work in a `StepProgram`) and a
device half (`execute_program`: steps 2-4). With tensor parallelism
(`tensor_parallel_size` > 1) this process is rank 0: it prepares every step once and sends it
to the workers (`tp_driver`), and every rank runs the device half on its shard of the model
(`adaspec/parallel`). They choose the same tokens without a word: the logits every rank
verifies come from one all-gather (the same bytes everywhere), the hidden states from
all-reduces that give every rank the same sum, and sampling draws its noise from each
request's seed and position, so identical logits make identical choices, drafts and KV
(`tp_driver` says why rank 0 does not broadcast the tokens instead).
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass

import torch

from adaspec.config import EngineConfig
from adaspec.device.select import resolve_backend, resolve_device
from adaspec.device.landing import Landing
from adaspec.device.marks import StepMarks
from adaspec.device.shift import Shift
from adaspec.device.staging import Staging
from adaspec.engine.cuda_graph import CudaGraphs, GraphInputs
from adaspec.engine.device_rows import DeviceRows
from adaspec.engine.draft_refresh import DraftRefresh, refresh_entries, stage_refresh_meta
from adaspec.engine.draft_step import ChainDrafter, TreeStep
from adaspec.engine.grammar_step import GrammarMasks, grammar_available, grammar_step
from adaspec.engine.step_plan import StepPlan, StepResult
from adaspec.engine.step_layout import StepLayout, forward_inputs, layout_step, shifted_rows, stage_forward_inputs
from adaspec.engine.kernel_warm_up import warm_up_kernels
from adaspec.engine.kv_memory import kv_bytes_per_block, num_kv_blocks
from adaspec.engine.penalty_step import attach_logprobs, attach_prompt_logprobs, prompt_logprob_rows, \
    prompt_logprobs
from adaspec.engine.step_program import ProgramCodec, StepProgram, count_launches, phase
from adaspec.engine.verify_step import PostForward, read_out_rows, stage_verify, verify_inputs
from adaspec.layers import pdl
from adaspec.layers.attention import ForwardContext, forward_context, get_backend
from adaspec.models.loader import load_model
from adaspec.parallel import Shard, TPGroup
from adaspec.parallel.layers import parallelize
from adaspec.sampling import MAX_LOGPROBS
from adaspec.spec_decode.drafter import TreeDrafter
from adaspec.spec_decode.simulated import simulated_draws

@dataclass
class Launched:
    """A step whose device work is queued; `ModelRunner.collect` turns it into results."""

    plan: StepPlan
    lay: StepLayout
    out: torch.Tensor | None          # host copy of [count | emitted | path | depth] per verify row
    lp: torch.Tensor | None           # host copy of the logprob rows (penalty_step.token_logprobs)
    start: object                     # timer marks (CUDA events; wall-clock floats on CPU);
    end: object                       # `end` is recorded after the output copy
    prompt_lp: tuple | None = None    # (penalty_step.prompt_logprob_rows, host copy of their logprobs)
    all_lp: bool = False              # `lp` holds every verify row (a post graph's), not only those that ask
    second_half: tuple | None = None  # a grammar step's (program, forward outputs): `finish` queues its post


class ModelRunner:
    """`tp`: this process's rank of a tensor-parallel world (workers get theirs from
    `tp_worker`; a one-rank world runs the sharded layers alone). `driver`: this process is
    rank 0 of a tensor-parallel engine (`tp_driver.TPDriver`, started by the Engine): every
    step it prepares is sent to the workers (`launch`), and each rank runs the same device
    work on its shard."""

    def __init__(self, cfg: EngineConfig, tp: TPGroup | None = None, driver=None):
        self.cfg = cfg
        self.driver = driver
        tp = driver.tp if driver is not None else tp
        if cfg.tensor_parallel_size > 1 and (tp is None or tp.size != cfg.tensor_parallel_size):
            raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} needs its world: build the engine "
                             f"with Engine(cfg) (or LLM), which starts the workers")
        self.tp = tp
        self.device = tp.device if tp is not None else resolve_device(cfg.device)
        with driver.busy() if driver is not None else contextlib.nullcontext():
            self._build()

    def _build(self) -> None:
        cfg, tp = self.cfg, self.tp
        torch.manual_seed(cfg.seed)
        shard = Shard(tp.rank, tp.size, cfg.enable_expert_parallel) if tp is not None else None
        phase(tp, lambda: self._load_target(shard))
        self.backend = get_backend(resolve_backend(cfg.attention_backend, self.device))
        self.block_size = cfg.cache.block_size
        self.draft = None
        if cfg.spec.enabled:
            phase(tp, self._load_draft)
        # Programmatic dependent launch for a model the device waits on, not for one that waits
        # on the host (layers/pdl.py); chosen before any kernel is compiled or graph captured.
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.pdl = pdl.choose(weight_bytes) and pdl.enabled(torch.empty(0, device=self.device))
        self.model.capture = self.draft.aux_layers if self.draft is not None else ()
        ms = self.local_spec   # this rank's heads (all of them without tensor parallelism)
        self.group = ms.num_heads // ms.num_kv_heads
        self.num_blocks = num_kv_blocks(self.cfg, self.device, kv_bytes_per_block(
            self.dtype, self.local_spec, self.draft, self.block_size), self.model_spec.max_position)
        if tp is not None:   # KV capacity profiled on every rank: the minimum wins
            self.num_blocks = min(tp.exchange(self.num_blocks))
        # One block more than the scheduler hands out: padding requests of CUDA graphs map
        # every block to it (`setup`), so whatever they write lands where nothing reads.
        self.scratch_block = self.num_blocks
        phase(tp, self._allocate_kv)
        self.rows: DeviceRows | None = None
        self.graphs: CudaGraphs | None = None
        self.chain = self.trees = None
        self.max_model_len = 0
        self.marks = StepMarks(self.device)   # the steps' timing marks (`launch`, `finish`)
        self.last_step_time = 0.0
        self.last_wait = 0.0   # seconds `collect` was blocked on the device (engine.step_clock)
        self.prev_speculative = False   # the last launched step verified drafts
        self.grammar_masks: GrammarMasks | None = None
        self.launch_counts: Counter = Counter()   # step_program.count_launches

    def _load_target(self, shard: Shard | None) -> None:
        cfg = self.cfg
        self.model, self.model_spec, self.dtype = load_model(cfg.model, self.device, cfg.dtype, cfg.load_format,
                                                             cfg.seed, shard=shard)
        self.local_spec = self.model.spec
        self.model.fuse()
        if shard is not None:
            parallelize(self.model, self.model_spec, shard, self.tp)

    def _load_draft(self) -> None:
        from adaspec.spec_decode.eagle3_checkpoint import load_eagle3
        cfg = self.cfg   # replicated on every rank (draft TP 1): its inputs are complete on each
        self.draft = load_eagle3(cfg.spec.draft, self.model_spec, self.model.embed_tokens, self.device,
                                 self.dtype, cfg.load_format, cfg.seed)
        self.draft.fuse()

    def _allocate_kv(self) -> None:
        ms = self.local_spec
        L, S = ms.num_layers, (self.num_blocks + 1) * self.block_size
        # One tensor for every layer's K and V: accepted tree KV moves with one index op.
        self.kv = torch.zeros(L, 2, S, ms.num_kv_heads, ms.head_dim, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(L)]
        self.draft_cache = self.draft_kv = None
        if self.draft is not None:  # one (k, v) pair per draft layer (most heads have one)
            ds = self.draft.spec
            self.draft_kv = torch.zeros(self.draft.num_layers, 2, S, ds.num_kv_heads, ds.head_dim, dtype=self.dtype,
                                        device=self.device)
            self.draft_cache = [(self.draft_kv[i, 0], self.draft_kv[i, 1]) for i in range(self.draft.num_layers)]
            self.draft_group = ds.num_heads // ds.num_kv_heads

    def setup(self, max_model_len: int) -> None:
        """Size the persistent device state for `max_model_len` (called once by the engine;
        with tensor parallelism on every rank: rank 0 has its workers do the same)."""
        if self.driver is not None:
            self.driver.setup(max_model_len)
        with self.driver.busy() if self.driver is not None else contextlib.nullcontext():
            phase(self.tp, lambda: self._setup(max_model_len))
            if self.graphs is not None:
                self.graphs.capture_all()
        if self.device.type == "cuda":
            warm_up_kernels(self)
        if self.driver is not None:
            self.driver.attach(ProgramCodec(self))

    def _setup(self, max_model_len: int) -> None:
        sc, spc = self.cfg.scheduler, self.cfg.spec
        self.max_model_len = max_model_len
        self.max_draft = max(spc.num_steps, spc.resolved_num_draft_tokens) if self.draft is not None else 0
        # A step planned before the previous one was read back may sit up to max_draft
        # positions further than planned (see device.shift.Shift): room for both.
        max_pos = max_model_len + 2 * self.max_draft + 2
        self.model.prepare_rotary(max_pos, self.device)
        if self.draft is not None:
            self.draft.prepare_rotary(max_pos, self.device)
        max_blocks = (max_pos + 1 + self.max_draft * max(1, spc.topk)) // self.block_size + 2
        hidden = self.draft.spec.hidden_size if self.draft is not None else None
        self.rows = DeviceRows(2 * sc.max_num_seqs + 8, max_blocks, self.device, hidden, self.dtype,
                               emitted_width=self.max_draft + 1)
        self.rows.block_table[self.rows.pad_row] = self.scratch_block
        n = spc.resolved_num_draft_tokens if self.draft is not None else 1
        max_rows = sc.max_num_batched_tokens + sc.max_num_seqs * (n + 1)
        nbytes = 256 * max_rows * (self.max_draft + 3) + 16 * sc.max_num_seqs * n * n + (1 << 20)
        self.stg = Staging(nbytes, self.device)
        k = max(1, spc.topk) if self.draft is not None else 1
        self.draft_stg = Staging(64 * sc.max_num_seqs * (self.max_draft + 1) * 8 * k
                                 + sc.max_num_seqs * k * k * self.max_draft ** 2 + (1 << 16), self.device)
        # Pinned landing buffers for the step outputs, alternating so that step N+1's copy
        # never overwrites step N's before `collect` read it.
        width = 2 + 2 * max(self.max_draft + 1, n)   # count | emitted [N] | path [N] | depth
        pin = self.device.type == "cuda"
        self._out_host = Landing(sc.max_num_seqs * width, torch.int64, pin)
        lp_width = (self.max_draft + 1) * (1 + 2 * MAX_LOGPROBS)   # token_logprobs rows of a request
        self._lp_host = Landing(sc.max_num_seqs * lp_width, torch.float32, pin)
        refresh = None
        if self.draft is not None:
            bt, pr = self.rows.block_table, self.rows.pad_row
            self.chain = ChainDrafter.build(self.draft, self.backend, self.draft_cache, self.draft_group, self.rows,
                                            self.stg, self.block_size, sc.max_num_seqs, max(1, spc.num_steps))
            self.trees = TreeStep(TreeDrafter(self.draft, self.backend, self.block_size, self.draft_group),
                                  self.draft_cache, bt, pr)
            refresh = DraftRefresh(self.draft, self.backend, self.draft_cache, self.rows.draft_hidden)
        # Structured outputs need rank 0 alone (grammar_step.TP_UNSUPPORTED).
        if self.cfg.tensor_parallel_size == 1:
            self.grammar_masks = GrammarMasks(self.device, sc.max_num_seqs * max(n, self.max_draft + 1),
                                              self.model_spec.vocab_size)
        self.post = PostForward(self.model.lm_head, self.rows.last_token, self.rows.last_count,
                                self.rows.last_emitted, self.kv,
                                self.rows.block_table, self.block_size, refresh)
        if self.device.type == "cuda" and self.backend.graphable and not self.cfg.enforce_eager:
            self.graphs = self.make_graphs()   # (captured on every rank in the same order:
                                               # the collectives inside meet)

    def make_graphs(self) -> CudaGraphs:
        """The graph owner, with its collaborators named (nothing else of the runner)."""
        d = self.draft
        return CudaGraphs(GraphInputs(
            spec=self.cfg.spec, max_num_seqs=self.cfg.scheduler.max_num_seqs, max_model_len=self.max_model_len,
            max_token_rows=min(self.cfg.cuda_graph_max_tokens, self.cfg.scheduler.max_num_batched_tokens),
            model=self.model, backend=self.backend, kv_caches=self.kv_caches, group=self.group,
            block_size=self.block_size, block_table=self.rows.block_table, pad_row=self.rows.pad_row, stg=self.stg,
            draft_stg=self.draft_stg, post=self.post, grammar_masks=self.grammar_masks if grammar_available() else None,
            chain=self.chain, trees=self.trees.drafter if self.trees is not None else None,
            draft_cache=self.draft_cache, draft_layers=d.num_layers if d else 0, dtype=self.dtype, device=self.device,
            draft_hidden_size=d.spec.hidden_size if d is not None else 0, tp=self.tp))

    # ---- the step -------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> list[StepResult]:
        """Run one step to completion (launch, then collect)."""
        return self.collect(self.launch(plan))

    def plans_ahead(self, plan: StepPlan) -> bool:
        """True when the next step can be planned and launched while `plan` runs. Positions of
        the next step are shifted on the device by what `plan` emitted (device.shift.Shift);
        a multi-layer draft head's refresh forward is not shifted, so its speculative steps
        are waited for."""
        return not (plan.speculative and self.draft is not None and self.draft.num_layers > 1)

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        """Queue one step on the device; nothing waits for it. The step's time is measured
        with CUDA events: one enqueued at the start fires when the stream reaches it, so the
        span counts host preparation only while the device waits for it (right under overlap).
        A step with a grammar is queued up to its target forward: `finish` queues the rest."""
        timer = self.marks.mark()
        lay, prog = self._prepare(plan)
        self.prev_speculative = plan.speculative
        with self._tp_step():
            if self.driver is not None:   # the program, then the staged buffers broadcast
                self.driver.send(prog)
            fwd = self.forward_half(prog)
            step = Launched(plan, lay, None, None, timer, None, second_half=(prog, fwd))
            if prog.grammar is None:
                self.finish(step)
        return step

    @torch.inference_mode()
    def finish(self, step: Launched) -> None:
        """Queue the rest of a launched step (a no-op once queued). A grammar step's bitmask
        is filled here, from matchers that know every token read back so far: the engine calls
        this after it applied the step before (`grammar_step` says why)."""
        if step.second_half is None:
            return
        (prog, fwd), step.second_half = step.second_half, None
        with self._tp_step():
            out, lp = self.post_half(prog, fwd)
        step.all_lp = prog.post is not None and lp is not None
        if fwd[3] is not None:   # the step's prompt logprobs (eager: a tensor of their own)
            rows, t = fwd[3]
            step.prompt_lp = (rows, t.to("cpu", non_blocking=True))
        step.out, step.lp, step.end = self._out_host.take(out), self._lp_host.take(lp), self.marks.mark()

    def collect(self, step: Launched) -> list[StepResult]:
        """Wait for a launched step and return its results (one per scheduled request);
        sets `self.last_step_time` (seconds)."""
        self.finish(step)
        start, end = step.start, step.end
        if self.device.type == "cuda":
            t = time.perf_counter()
            with self._tp_step():
                end.synchronize()
            self.last_wait = time.perf_counter() - t
            self.last_step_time = start.elapsed_time(end) / 1e3
        else:
            self.last_step_time = end - start
        results = [StepResult(emitted=[]) for _ in step.plan.scheduled]
        if step.out is not None:
            read_out_rows(step.out, step.lay, results)
        if step.lp is not None:
            attach_logprobs(step.plan, step.lay.verify, step.lp, results, step.all_lp)
        if step.prompt_lp is not None:
            attach_prompt_logprobs(step.plan, step.prompt_lp, results)
        return results

    def _tp_step(self):
        """Rank 0 of a tensor-parallel engine: a step's part where a dead worker shows (as an
        error, or a hang the driver breaks); see TPDriver.step."""
        return self.driver.step() if self.driver is not None else contextlib.nullcontext()

    def _prepare(self, plan: StepPlan) -> tuple[StepLayout, StepProgram]:
        """The host half of a step: lay it out, stage it (ONE host->device copy per staging
        buffer), and name the device work in a StepProgram."""
        sched = plan.scheduled
        rows = [self.rows.row_of(s.req) for s in sched]
        lay = layout_step(plan, self.prev_speculative)
        N, D = lay.N, lay.D
        slack = self.max_draft if lay.shifted else 0
        fi = forward_inputs(plan, lay, rows, self.block_size)
        graph = self.graphs.lookup(fi.q_lens, lay.tree) if self.graphs is not None else None
        extra = (graph.batch if graph is not None else len(sched)) - len(sched)
        params = [sched[i].req.params for i in lay.verify]
        sim = self.cfg.spec.simulate_accept_rate if N > 1 else None
        # Everything after the forward replays as one graph when the forward does, every
        # request is a decoder that samples, every row is greedy and unpenalized, and the rows
        # want at most one extra: logprobs, or a grammar's bitmask (`CudaGraphs.post_extras`).
        # A step in which no request refreshes its draft replays a post graph without the
        # refresh: requests that do not speculate cost what they cost without a draft head.
        grammars = [sched[i].req.grammar for i in lay.verify]
        want = {"logprobs"} if any(p.logprobs is not None for p in params) else set()
        want |= {"grammar"} if any(g is not None for g in grammars) else set()
        post = None
        graphable = all(p.greedy and not p.penalized for p in params) and len(want) <= 1
        if graph is not None and len(lay.verify) == len(sched) and all(L.n_new == 1 for L in lay.reqs) \
                and graphable:
            post = self.graphs.post_graph(graph, D, "sim" if sim is not None else "greedy",
                                          refresh=self.draft is not None and any(s.refresh for s in sched),
                                          extra=next(iter(want), None))
        if graph is not None:   # padded to the graph's batch, or to a token graph's rows and slots
            graph.fit(fi)
        stg = self.stg
        stg.begin()
        shift = shift_d = srows = sreqs = None
        if lay.shifted:
            shift = Shift(stg)
            shift_d = Shift(self.draft_stg) if lay.tree else None   # (trees stage in the drafters' buffer)
            srows, sreqs = shifted_rows(lay, rows)
        meta, ids_d, pos_d = stage_forward_inputs(
            stg, self.backend, self.rows.block_table, self.block_size, self.group, fi, lay.tree,
            rows + [self.rows.pad_row] * extra, max_ctx_len=(max(fi.ctx) + slack) if fi.ctx else 0,
            shift=shift, shift_rows=srows, shift_reqs=sreqs, launch=graph.launch if graph is not None else None)
        # The post-forward inputs come right after the forward's metadata, so that a post
        # graph finds them where its capture staged them. With a post graph the verify batch
        # and the refresh are padded to the graph's batch (padding rows change nothing).
        vpad = extra if post is not None else 0
        refresh = None
        if self.draft is not None:
            refresh = refresh_entries(sched, lay.reqs, D if post is not None else None, vpad, N, self.rows.pad_row,
                                      self.block_size)
        vi = verify_inputs(lay, vpad, self.rows.pad_row, rows)
        vreqs = [sched[i].req for i in lay.verify]
        vb = stage_verify(stg, vi, simulated_draws(vreqs, vpad, N, sim, self.cfg.spec.simulate_seed), refresh, N, D,
                          lay.tree, params, [r.seed for r in vreqs], reqs=None if post is not None else vreqs)
        if refresh is not None:
            stage_refresh_meta(stg, vb.refresh, refresh, shift, self.draft.num_layers, self.backend,
                               self.rows.block_table, self.block_size, self.draft_group)
        upd = self.rows.table_updates([s.req for s in sched])
        upd_d = stg.add(upd, torch.int64) if upd is not None else None
        fill = stg.add([fi.fill_at, fi.fill_from], torch.int64) if fi.fill_at else None
        rfill = stg.add([refresh.fill_at, refresh.fill_from], torch.int64) \
            if refresh is not None and refresh.fill_at else None
        chain = self.chain.stage(stg, plan, lay, rows, ids_d, vb, self.graphs, self.max_draft, shift) \
            if lay.chain else None
        trees = self.trees.stage(stg, self.draft_stg, plan, lay, rows, fi.tree_offsets, self.graphs, shift_d,
                                 self.max_draft) if lay.tree and lay.drafting else None
        in_graph = chain.shift if chain else None   # (the draft graph applies it)
        shifts = [(sh, sh.stage(stg)) for sh in (shift, shift_d) if sh and sh is not in_graph]
        stg.commit()
        count_launches(self.launch_counts, graph, post, bool(lay.verify), chain, trees)
        plp = prompt_logprob_rows(plan, lay)
        prompt_lp = (plp, max(sched[i].req.params.prompt_logprobs for i, _, _, _ in plp)) if plp else None
        return lay, StepProgram(meta, ids_d, pos_d, graph, post, vb, bool(lay.verify), upd_d, fill, chain, trees,
                                shifts, stg.offset, self.draft_stg.offset if trees else 0, prompt_lp,
                                rfill, grammar_step(grammars, vi.limit, N, lay.tree, lay.drafting))

    def execute_program(self, p: StepProgram) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The device half of a step (every rank runs it on its own buffers); returns the
        device output rows and logprob rows (None when nothing sampled / asked for them)."""
        return self.post_half(p, self.forward_half(p))

    def forward_half(self, p: StepProgram) -> tuple:
        """Block-table updates, shifts, drafts, the target forward; (hidden, aux, drafts
        being read back for a grammar step's mask or None, (prompt logprob rows, their device
        logprobs) or None)."""
        self.rows.apply_updates(p.upd.t if p.upd is not None else None)
        for sh, staged in p.shifts:   # after the block-table update: slots are looked up in it
            sh.apply(staged, self.rows.last_count, self.rows.block_table, self.block_size)
        ids_d, pos_d, vb = p.ids, p.pos, p.vb
        if p.fill is not None:
            ids_d[p.fill.t[0]] = self.rows.last_token[p.fill.t[1]]
        if p.rfill is not None:   # before this step's verification overwrites last_token
            vb.refresh.fields["token"].t[p.rfill.t[0]] = self.rows.last_token[p.rfill.t[1]]

        # ---- draft (on the device) ----
        if p.chain is not None:
            self.chain.run(p.chain)
        if p.trees is not None:
            self.trees.run(p.trees, self.rows.draft_hidden, p.meta, ids_d, pos_d, vb.tokens.t, vb.parents.t,
                           vb.limit.t)
        drafts = self.grammar_masks.read_drafts(p.grammar, vb) if p.grammar is not None else None

        # ---- target forward ----
        if p.graph is not None:
            hidden, aux = p.graph.replay()
        else:
            with forward_context(ForwardContext(p.meta, self.backend, self.kv_caches)):
                hidden, aux = self.model(ids_d, pos_d)
        prompt_lp = None
        if p.prompt_lp is not None:
            plp, k = p.prompt_lp
            prompt_lp = (plp, prompt_logprobs(self.model.lm_head, hidden, plp, k))
        return hidden, aux, drafts, prompt_lp

    def post_half(self, p: StepProgram, fwd: tuple) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Verification, commit and output (one post graph, or the same work eagerly), after
        the grammar step's bitmask is in place; or the draft refresh alone when nothing samples."""
        hidden, aux, drafts, _ = fwd
        vb = p.vb
        if p.grammar is not None:   # (simulated acceptance: forbidden drafts replaced, `GrammarMasks.masks`)
            vb.grammar = self.grammar_masks.masks(p.grammar, drafts, vb.tokens.t if vb.accept is not None else None)
        if not p.verifies:
            if vb.refresh is not None:
                self.post.refresh.run(vb.refresh, aux)
            return None, None
        return p.post.replay() if p.post is not None else self.post(hidden, aux, p.pos, vb)

    def close(self) -> None:
        """Stop the workers of a tensor-parallel engine (nothing to do for one process)."""
        if self.driver is not None:
            self.driver.close()
