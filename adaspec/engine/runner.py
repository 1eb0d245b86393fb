"""The model runner: executes a StepPlan on the device. It never decides what to run and never
allocates KV; it reads the block tables the scheduler prepared.

One step (see `execute`):
  1. stage   every input of the step (target forward first, then draft steps, the draft
             refresh and block-table updates) into one pinned buffer; ONE host->device copy
  2. draft   on the device, no sync: chains (`draft_chain`, graph-captured), trees
             (`spec_decode.drafter`, whose output fills the target's ids, positions and mask)
  3. target  one forward over prefill chunks, decodes and drafts (a CUDA graph when the batch
             is uniform: every request has the same number of query rows)
  4. verify  batched on the device (greedy, rejection sampling, simulated acceptance)
  5. commit  accepted tree KV moved into place, the draft KV refreshed for every request
             (4 and 5 replay as one "post" CUDA graph after a target graph, `_post`)
  6. read    ONE device->host copy of the emitted tokens, queued; `collect` waits for it

`launch` enqueues steps 1-6 and returns; `collect` waits and builds the StepResults. Between
the two the engine plans and launches the next step (overlap): a request whose last token is
still on the device (`Request.pending`) gets it from `DeviceRows.last_token`, filled on the
device before the forward.

Row layout of the target forward: request i owns `num_new` committed rows; in a speculative
step every decoding request also owns N-1 draft rows (N = the step's tree size), padded when
its own budget is smaller (padding rows write no KV and are never accepted), so decode and
verify batches stay uniform and graph-friendly.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from adaspec.config import EngineConfig
from adaspec.device.shift import Shift
from adaspec.device.staging import Staging, stage_forward
from adaspec.engine.device_rows import DeviceRows
from adaspec.engine.scheduler import StepPlan, StepResult
from adaspec.layers.attention import ForwardContext, forward_context, get_backend
from adaspec.models.loader import load_model
from adaspec.sampling import process_logits
from adaspec.spec_decode import verifier
from adaspec.spec_decode.drafter import TreeDrafter

CPU_DEFAULT_KV_BYTES = 128 * 2**20
log = logging.getLogger("adaspec")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but CUDA is not available")
    return dev


def resolve_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
            return "triton"
        except ImportError:
            return "torch"
    return "torch"


@dataclass
class Launched:
    """A step whose device work is queued; `ModelRunner.collect` turns it into results."""

    plan: StepPlan
    lay: list
    V: list[int]                      # scheduled indices that sample, in verify order
    D: int                            # deepest path the verifier could accept
    out: torch.Tensor | None          # host copy of [count | emitted | path | depth] per verify row
    start: object                     # timer marks (CUDA events; wall-clock floats on CPU);
    end: object                       # `end` is recorded after the output copy


@dataclass
class _Req:
    """Host-side layout of one scheduled request in this step's target forward."""

    row0: int          # first query row
    n_new: int         # committed rows
    pad: int           # draft rows (N - 1 when the request is verified, else 0)
    depth: int         # its own draft depth (0 = not speculating)
    nodes: int         # its own draft nodes
    vi: int            # index in the verify batch (-1: does not sample this step)


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.model, self.spec, self.dtype = load_model(cfg.model, self.device, cfg.dtype, cfg.load_format, cfg.seed)
        self.model.fuse()
        self.backend = get_backend(resolve_backend(cfg.attention_backend, self.device))
        self.block_size = cfg.cache.block_size
        self.draft = None
        if cfg.spec.enabled:
            from adaspec.spec_decode.eagle3 import load_eagle3
            self.draft = load_eagle3(cfg.spec.draft, self.spec, self.model.embed_tokens, self.device,
                                     self.dtype, cfg.load_format, cfg.seed)
            self.draft.fuse()
        self.model.capture = self.draft.aux_layers if self.draft is not None else ()
        self.group = self.spec.num_heads // self.spec.num_kv_heads
        self.num_blocks = self._num_blocks()
        # One block more than the scheduler hands out: padding requests of CUDA graphs map
        # every block to it (`setup`), so whatever they write lands where nothing reads.
        self.scratch_block = self.num_blocks
        L, S = self.spec.num_layers, (self.num_blocks + 1) * self.block_size
        # One tensor for every layer's K and V: accepted tree KV moves with one index op.
        self.kv = torch.zeros(L, 2, S, self.spec.num_kv_heads, self.spec.head_dim, dtype=self.dtype,
                              device=self.device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(L)]
        self.draft_cache = None
        if self.draft is not None:  # one (k, v) pair per draft layer (most heads have one)
            ds = self.draft.spec
            self.draft_kv = torch.zeros(self.draft.num_layers, 2, S, ds.num_kv_heads, ds.head_dim, dtype=self.dtype,
                                        device=self.device)
            self.draft_cache = [(self.draft_kv[i, 0], self.draft_kv[i, 1]) for i in range(self.draft.num_layers)]
            self.draft_group = ds.num_heads // ds.num_kv_heads
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.sim_generator = np.random.default_rng(cfg.spec.simulate_seed)
        self.rows: DeviceRows | None = None
        self.graphs = None
        self.max_model_len = 0
        self.last_step_time = 0.0
        self.prev_speculative = False   # the last launched step verified drafts

    def setup(self, max_model_len: int) -> None:
        """Size the persistent device state for `max_model_len` (called once by the engine)."""
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
        self.rows = DeviceRows(2 * sc.max_num_seqs + 8, max_blocks, self.device, hidden, self.dtype)
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
        self._out_host = [torch.empty(sc.max_num_seqs * width, dtype=torch.int64, pin_memory=pin)
                          for _ in range(2)]
        self._out_flip = 0
        self.tree_drafter = (TreeDrafter(self.draft, self.backend, self.block_size, self.draft_group)
                             if self.draft is not None else None)
        if self.device.type == "cuda" and self.backend.graphable and not self.cfg.enforce_eager:
            from adaspec.engine.cuda_graph import CudaGraphs
            self.graphs = CudaGraphs(self)
            self.graphs.capture_all()
        if self.device.type == "cuda":
            self._warm_up_kernels()

    def _warm_up_kernels(self) -> None:
        """Compile the attention variants eager steps (prefill, mixed batches) can launch, and
        the shift kernels, now rather than at their first use while serving. A failure here
        costs only those stalls."""
        t0 = time.perf_counter()
        heads = [(self.spec.num_heads, self.kv_caches[0], self.dtype, set(self.spec.sliding_windows))]
        if self.draft is not None:
            ds = self.draft.spec
            heads.append((ds.num_heads, self.draft_cache[0], self.dtype, {None}))
        n = 0
        try:
            for num_heads, cache, dtype, windows in heads:
                n += self.backend.warm_up(num_heads, cache, self.rows.block_table, self.block_size, dtype, windows)
            if self.draft is not None:   # the in-flight shift of speculative steps
                from adaspec.device import shift_kernels
                n += 2 * shift_kernels.warm_up(self.rows.last_count, self.rows.block_table, self.block_size)
            torch.cuda.synchronize()
        except Exception as ex:  # an optimization: never a reason not to serve
            log.warning("attention warm-up failed (%s); kernels compile at first use", ex)
            return
        if n:
            log.info("attention kernels warmed up: %d launches in %.1f s", n, time.perf_counter() - t0)

    # ---- memory ---------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        el = torch.tensor([], dtype=self.dtype).element_size()
        per_tok = 2 * self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim * el
        if self.draft is not None:
            per_tok += 2 * self.draft.num_layers * self.draft.spec.num_kv_heads * self.draft.spec.head_dim * el
        return per_tok * self.block_size

    def _num_blocks(self) -> int:
        c = self.cfg.cache
        if c.num_blocks is not None:
            return c.num_blocks
        budget = c.memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * c.gpu_memory_utilization) - 4 * 2**30  # activations, graphs
            else:
                budget = CPU_DEFAULT_KV_BYTES
        useful = self.cfg.scheduler.max_num_seqs * (self.spec.max_position // self.block_size + 2)
        return max(1, min(budget // self.bytes_per_block(), useful))

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
        span counts host preparation only while the device waits for it (right under overlap)."""
        timer = self._timer_mark()
        lay, V, D, out = self._execute(plan)
        self.prev_speculative = plan.speculative
        if out is not None and self.device.type == "cuda":
            host = self._out_host[self._out_flip][: out.numel()].view(out.shape)
            self._out_flip ^= 1
            host.copy_(out, non_blocking=True)
            out = host
        elif out is not None:   # a graph's static output is overwritten by the next step
            out = out.clone()
        return Launched(plan, lay, V, D, out, timer, self._timer_mark())

    def collect(self, step: Launched) -> list[StepResult]:
        """Wait for a launched step and return its results (one per scheduled request);
        sets `self.last_step_time` (seconds)."""
        start, end = step.start, step.end
        if self.device.type == "cuda":
            end.synchronize()
            self.last_step_time = start.elapsed_time(end) / 1e3
        else:
            self.last_step_time = end - start
        sched, lay = step.plan.scheduled, step.lay
        results = [StepResult(emitted=[]) for _ in sched]
        if step.out is None:
            return results
        out = step.out.tolist()
        D = step.D
        for k, i in enumerate(step.V):
            row = out[k]
            cnt = row[0]
            L = lay[i]
            results[i] = StepResult(emitted=row[1:1 + cnt], num_accepted=cnt - 1,
                                    tree_depth=row[-1] if L.pad else 0, tree_nodes=L.nodes if L.pad else 0,
                                    path=row[2 + D: 2 + D + cnt - 1])
        return results

    def _timer_mark(self):
        """A point in the stream (a recorded CUDA event), or the wall clock on CPU."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _execute(self, plan: StepPlan):
        """Stage and enqueue the step; returns (layout, verify indices, N, device output)."""
        sched = plan.scheduled
        reqs = [s.req for s in sched]
        rows = [self.rows.row_of(r) for r in reqs]
        spec = [i for i, s in enumerate(sched) if s.draft is not None]
        topk = max((sched[i].draft.topk for i in spec), default=1)
        chain = bool(spec) and topk == 1
        # N: nodes verified per sampling request this step (root included).
        if not spec:
            N = 1
        elif chain:
            N = 1 + max(sched[i].draft.num_steps for i in spec)
        else:
            N = max(sched[i].draft.num_draft_tokens for i in spec)
        tree_mode = bool(spec) and not chain
        # The deepest path verification may accept: a tree of N nodes is only num_steps deep.
        D = max(sched[i].draft.num_steps for i in spec) if tree_mode else N - 1

        # Requests whose previous step is in flight and may have emitted more than one token:
        # their positions are corrected on the device (device.shift.Shift).
        shifted = [i for i, s in enumerate(sched) if s.req.pending] if self.prev_speculative else []
        slack = self.max_draft if shifted else 0

        # ---- 1. layout and staging ----
        lay: list[_Req] = []
        t = 0
        nv = 0
        for i, s in enumerate(sched):
            decoding = s.samples and s.num_new_tokens == 1
            pad = N - 1 if (decoding and spec) else 0
            d = s.draft   # a tree's depth is known on the device only: its budget bounds it
            depth = d.num_steps if d is not None else 0
            nodes = d.num_nodes if d is not None else 0
            lay.append(_Req(t, s.num_new_tokens, pad, depth, nodes, nv if s.samples else -1))
            nv += s.samples
            t += s.num_new_tokens + pad
        # Plain lists, one append per row: per-request numpy calls cost more than the
        # arithmetic at large batches.
        ids, pos, cidx, slots = [], [], [], []
        fill_at, fill_from = [], []   # rows whose token is still on the device (overlap)
        q_lens, ctx, mstart, moff = [], [], [], []
        mask_parts = []
        moffs = []          # mask offset of each speculating request (trees)
        moffset = 0
        bs = self.block_size
        for i, (s, L) in enumerate(zip(sched, lay)):
            r, c, nn = s.req, s.req.num_computed, L.n_new
            blocks = r.block_ids
            if nn == 1:
                if c < len(r.all_token_ids):
                    ids.append(r.all_token_ids[c])
                else:
                    ids.append(0)
                    fill_at.append(L.row0)
                    fill_from.append(rows[i])
                pos.append(c)
                cidx.append(c)
                slots.append(blocks[c // bs] * bs + c % bs if c >= r.no_kv_write_below else -1)
            else:
                ids.extend(r.all_token_ids[c:c + nn])
                rng = range(c, c + nn)
                pos.extend(rng)
                cidx.extend(rng)
                nkw = r.no_kv_write_below
                slots.extend(blocks[p // bs] * bs + p % bs if p >= nkw else -1 for p in rng)
            q_lens.append(nn + L.pad)
            if L.pad == 0:
                ctx.append(c + nn)
                mstart.append(c + nn)
                moff.append(0)
                continue
            n = r.num_tokens  # root = token n-1 at cache index n-1; draft node j at n-1+j
            cidx.extend(range(n, n - 1 + N))
            ids.extend([0] * (N - 1))     # drafted on the device
            if tree_mode:   # positions n-1+depth and the mask come from the drafted trees
                pos.extend([n - 1] * (N - 1))
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(n, n + L.nodes))
                slots.extend([-1] * (N - 1 - L.nodes))
            else:
                pos.extend(range(n, n - 1 + N))
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(n, n + L.depth))
                slots.extend([-1] * (N - 1 - L.depth))
            if tree_mode:   # tree region = the N nodes, root included; drafted trees fill theirs
                m = np.zeros(N * N, dtype=np.uint8)
                m[0] = 1
                mask_parts.append(m)
                if s.draft is not None:
                    moffs.append(moffset)
                ctx.append(n - 1 + N)
                mstart.append(n - 1)
                moff.append(moffset)
                moffset += N * N
            else:          # chain: causal by cache index; the request's own depth bounds its keys
                ctx.append(n + L.depth)
                mstart.append(n + L.depth)
                moff.append(0)
        graph = self.graphs.lookup(q_lens, tree_mode) if self.graphs is not None else None
        B_pad = graph.batch if graph is not None else len(sched)
        extra = B_pad - len(sched)
        # Verify batch: the requests that sample, in schedule order.
        V = [i for i in range(len(sched)) if lay[i].vi >= 0]
        params = [sched[i].req.params for i in V]
        sim = self.cfg.spec.simulate_accept_rate if spec else None
        # Everything after the forward replays as one graph when the forward does, every
        # request is a decoder that samples, and no request needs its own generator.
        post = None
        if graph is not None and len(V) == len(sched) and all(L.n_new == 1 for L in lay) \
                and all(p.greedy for p in params):
            post = self.graphs.post_graph(graph, D, "sim" if sim is not None else "greedy")
        if extra:  # padding requests of the captured batch size: no keys, no KV writes
            q = q_lens[0]
            ids += [0] * (extra * q)
            pos += [0] * (extra * q)
            cidx += [0] * (extra * q)
            slots += [-1] * (extra * q)
            q_lens += [q] * extra
            ctx += [0] * extra
            mstart += [0] * extra
            moff += [0] * extra
            if tree_mode:
                mask_parts += [np.zeros(N * N, np.uint8)] * extra
        req_row = rows + [self.rows.pad_row] * extra
        stg = self.stg
        stg.begin()
        shift = shift_d = None
        if shifted:
            shift, shift_d = Shift(stg), Shift(self.draft_stg)
            srows = [(j, rows[i]) for i in shifted for j in range(lay[i].row0, lay[i].row0 + lay[i].n_new + lay[i].pad)]
            shift_rows = ([j for j, _ in srows], [r for _, r in srows])
            shift_reqs = (shifted, [rows[i] for i in shifted])
        meta, ids_d, pos_d = stage_forward(
            stg, self.backend, self.rows.block_table, self.block_size, self.group, q_lens=q_lens, ctx_len=ctx,
            kv_start=[0] * B_pad, req_row=req_row, positions=pos, cache_index=cidx, slots=slots, input_ids=ids,
            mask_start=mstart if tree_mode else None, mask_offset=moff if tree_mode else None,
            mask=np.concatenate(mask_parts) if mask_parts else None,
            max_ctx_len=(max(ctx) + slack) if ctx else 0,
            shift=shift, shift_rows=shift_rows if shifted else None, shift_reqs=shift_reqs if shifted else None)

        # The post-forward inputs come right after the forward's metadata, so that a post
        # graph finds them where its capture staged them. With a post graph the verify batch
        # and the refresh are padded to the graph's batch (padding rows change nothing).
        vpad = extra if post is not None else 0
        vrows, vtok, vpar, vlim = [], [], [], []
        chain_par = list(range(-1, N - 1))
        for i in V:
            L = lay[i]
            last = L.row0 + L.n_new - 1
            if not L.pad:
                vrows.extend([last] * N)
                vtok.extend([0] * N)
                vpar.extend([-1] * N)
                vlim.append(0)
                continue
            vrows.extend(range(last, last + N))
            vlim.append(L.depth)
            vtok.extend([0] * N)   # the root's token is never compared; drafts come from the device
            vpar.extend(chain_par)  # trees: overwritten on the device
        for e in range(vpad):      # a padding request's rows: its own (q = N of them)
            vrows.extend(range((len(sched) + e) * N, (len(sched) + e + 1) * N))
            vtok.extend([0] * N)
            vpar.extend(chain_par)
            vlim.append(0)
        Bv = len(V) + vpad
        shape = (Bv, N)
        refresh = None
        if self.draft is not None:
            refresh = self._refresh_arrays(sched, lay, reqs, D if post is not None else None, vpad, N)
        pb = self._stage_post(
            stg, np.array(vrows, dtype=np.int64).reshape(shape), np.array(vtok, dtype=np.int64).reshape(shape),
            np.array(vpar, dtype=np.int64).reshape(shape), vlim,
            self._sim_draws(len(V), vpad, N, sim),
            [rows[i] for i in V] + [self.rows.pad_row] * vpad, refresh)
        if refresh is not None:
            self._refresh_meta(stg, pb, refresh, reqs, shift)
        upd = self.rows.table_updates(reqs)
        upd_d = stg.add(upd, torch.int64) if upd is not None else None
        fill = stg.add([fill_at, fill_from], torch.int64) if fill_at else None
        drafts = self._stage_chain(stg, sched, lay, reqs, rows, N, shift_d) if chain else None
        tdraft = self._stage_trees(stg, sched, lay, reqs, rows, moffs, shift_d) if tree_mode else None
        shifts = [(sh, sh.stage(stg)) for sh in (shift, shift_d) if sh]
        stg.commit()
        self.rows.apply_updates(upd_d.t if upd_d is not None else None)
        for sh, staged in shifts:   # after the block-table update: slots are looked up in it
            sh.apply(staged, self.rows.last_count, self.rows.block_table, self.block_size)
        if fill is not None:
            ids_d[fill.t[0]] = self.rows.last_token[fill.t[1]]

        # ---- 2. draft (on the device) ----
        vtok_t = pb["vtok"].t
        if drafts is not None:
            vtok_t[drafts["vidx"].t, 1:] = self._run_chain(drafts, ids_d, N)
        if tdraft is not None:
            self._run_trees(tdraft, meta, ids_d, pos_d, vtok_t, pb["vpar"].t, pb["vlim"].t)

        # ---- 3. target forward ----
        if graph is not None:
            hidden, aux = graph.replay()
        else:
            with forward_context(ForwardContext(meta, self.backend, self.kv_caches)):
                hidden, aux = self.model(ids_d, pos_d)
        if not V:
            if refresh is not None:
                self._run_refresh(pb["refresh"], aux, None, None, None)
            return lay, V, D, None
        # ---- 4-6. verify, commit, output (one graph, or the same work eagerly) ----
        if post is not None:
            out = post.replay()
        else:
            gens = [sched[i].req.generator for i in V]
            out = self._post(hidden, aux, pos_d, pb, N, D, tree_mode, params, gens)
        return lay, V, D, out

    # ---- after the forward ----------------------------------------------------------------
    def _sim_draws(self, B: int, pad: int, N: int, rate) -> np.ndarray | None:
        """Simulated acceptance: whether each draft of B requests is accepted (padding rows
        draw nothing, so padding never changes a later step's draws)."""
        if rate is None:
            return None
        acc = self.sim_generator.random((B, max(1, N - 1))) < rate
        return np.concatenate([acc, np.zeros((pad, acc.shape[1]), dtype=bool)]) if pad else acc

    @staticmethod
    def _stage_post(stg, vrows, vtok, vpar, vlim, sim, vsrc, refresh) -> dict:
        """Stage the post-forward inputs in one fixed order: the verify rows of the forward
        [Bv, N], draft tokens, parents and limits (drafts fill them on the device), simulated
        acceptance draws, the requests' device rows, and the draft refresh's arrays."""
        pb = {"vrows": stg.add(vrows, torch.int64), "vtok": stg.add(vtok, torch.int64),
              "vpar": stg.add(vpar, torch.int64), "vlim": stg.add(vlim, torch.int64),
              "sim": stg.add(sim, torch.uint8) if sim is not None else None,
              "vsrc": stg.add(vsrc, torch.int64)}
        if refresh is not None:
            # One field per array, each 16-byte aligned: a kernel given a row of one [7, R] block
            # (the positions, to the draft's rotary) would compile a variant per R mod 2.
            pb["refresh"] = {"arr": [stg.add(a, torch.int64) for a in refresh["arr"]],
                             "last": stg.add(refresh["last"], torch.int64),
                             "rows": stg.add(refresh["rows"], torch.int64), "meta": None}
        return pb

    def _post(self, hidden, aux, pos_d, pb, N, D, tree_mode, params, gens) -> torch.Tensor:
        """The step after the target forward, on the device: the LM head on the verify rows,
        verification, each request's last token and count (for the next step planned before
        this one is read), accepted tree KV moved into place, the draft KV refreshed. Returns
        the step's output rows [Bv, count | emitted [D+1] | path [D+1] | depth]. Captured as
        is by the post graphs (greedy and simulated verification)."""
        vrows, vsrc, vlim = pb["vrows"].t, pb["vsrc"].t, pb["vlim"].t
        Bv = vrows.shape[0]
        logits = self.model.lm_head(hidden[vrows.reshape(-1)]).view(Bv, N, -1)
        sim = pb["sim"].t.bool() if pb["sim"] is not None else None
        path, emitted, count = self._verify(params, gens, logits, pb["vtok"].t, pb["vpar"].t, vlim, sim, D, tree_mode)
        self.rows.last_token[vsrc] = emitted.gather(1, (count - 1).unsqueeze(1)).squeeze(1)
        self.rows.last_count[vsrc] = count
        if tree_mode:
            self._move_tree_kv(pos_d[vrows[:, 0]], vsrc, path, count)
        if "refresh" in pb:
            self._run_refresh(pb["refresh"], aux, path, emitted, count)
        return torch.cat([count.unsqueeze(1), emitted, path, vlim.unsqueeze(1)], dim=1)

    # ---- verification ---------------------------------------------------------------------
    def _verify(self, params, gens, logits, tokens, parents, limit, sim, D, tree_mode):
        """Batched verification of paths up to D deep; returns (path [B, D+1], emitted
        [B, D+1], count [B]). `params`/`gens`: each row's sampling parameters and generator."""
        B = logits.shape[0]
        greedy = all(p.greedy for p in params)
        if sim is not None:
            path, emitted, count = (verifier.verify_simulated(tokens, parents, limit, sim, D) if tree_mode
                                    else verifier.verify_chain_simulated(tokens, limit, sim))
            last = path.gather(1, (count - 1).unsqueeze(1)).squeeze(1)
            rows = logits[torch.arange(B, device=self.device), last]
            bonus = self._sample(rows, params)
            emitted.scatter_(1, (count - 1).unsqueeze(1), bonus.unsqueeze(1))
            return path, emitted, count
        if greedy:
            return (verifier.verify_greedy(tokens, parents, limit, logits.argmax(-1), D) if tree_mode
                    else verifier.verify_chain_greedy(tokens, limit, logits.argmax(-1)))
        N = logits.shape[1]
        probs = process_logits(logits.reshape(B * N, -1), [p for p in params for _ in range(N)])
        probs = probs.view(B, N, -1)
        if not tree_mode:
            u = self._uniform(B, D, gens)
            noise = self._exponential(B, probs.shape[-1], gens)
            return verifier.verify_chain_sampled(tokens, limit, probs, u, noise)
        W = self.cfg.spec.topk   # the most children a drafted node has
        u = self._uniform(B, D * W, gens).view(B, D, W)
        noise = self._exponential(B, probs.shape[-1], gens)
        return verifier.verify_tree_sampled(tokens, parents, limit, probs, u, noise, D)

    def _sample(self, logits: torch.Tensor, params) -> torch.Tensor:
        if all(p.greedy for p in params):
            return logits.argmax(-1)
        probs = process_logits(logits, params)
        noise = self._exponential(len(params), probs.shape[-1], [None] * len(params))
        return (probs / noise).argmax(-1)

    def _uniform(self, B, K, gens):
        u = torch.rand(B, K, device=self.device, generator=self.generator)
        for k, g in enumerate(gens):
            if g is not None and K:
                u[k] = torch.rand(K, device=self.device, generator=g)
        return u

    def _exponential(self, B, V, gens):
        noise = torch.empty(B, V, device=self.device).exponential_(generator=self.generator)
        for k, g in enumerate(gens):
            if g is not None:
                noise[k].exponential_(generator=g)
        return noise

    # ---- chain drafting on the device -----------------------------------------------------
    def _stage_chain(self, stg, sched, lay, reqs, rows, N, shift=None):
        """Stage the K draft steps of every speculating request. Step i feeds the pair
        (hidden, token) at cache index n-1+i, rotary position n-2+i, and sees keys 1 .. n-1+i
        of the draft cache (slot 0 is never read). The steps' metadata goes to the drafter's
        own static buffer (one more copy), laid out per (batch bucket, K) so that a captured
        draft graph finds it; indices into the target's rows go to the step's buffer."""
        spec = [i for i, s in enumerate(sched) if s.draft is not None and lay[i].pad]
        K = N - 1
        B = len(spec)
        graph = self.graphs.draft_graph(B, K) if self.graphs is not None else None
        pad = (graph.batch if graph is not None else B) - B
        bs = self.block_size
        ns = np.array([reqs[i].num_tokens for i in spec] + [2] * pad, dtype=np.int64)  # pads: positions >= 0
        depth = [lay[i].depth for i in spec]
        dstg = self.draft_stg
        dstg.begin()
        steps = []
        moved = [k for k, i in enumerate(spec) if reqs[i].pending] if shift is not None else []
        moved_rows = [rows[spec[k]] for k in moved]
        slack = self.max_draft if moved else 0
        for st in range(K):
            slots = [reqs[i].block_ids[(n - 1 + st) // bs] * bs + (n - 1 + st) % bs if st < d else -1
                     for i, n, d in zip(spec, ns, depth)] + [-1] * pad
            ctx = np.concatenate([ns[:B] + st, np.zeros(pad, np.int64)])
            meta, _, pos = stage_forward(
                dstg, self.backend, self.rows.block_table, self.block_size, self.draft_group,
                q_lens=[1] * (B + pad), ctx_len=ctx,
                kv_start=[1] * (B + pad), req_row=[rows[i] for i in spec] + [self.rows.pad_row] * pad,
                positions=ns - 2 + st, cache_index=ns - 1 + st, slots=slots,
                max_ctx_len=int(ctx.max()) + slack if len(ctx) else 0,
                shift=shift if moved else None, shift_rows=(moved, moved_rows), shift_reqs=(moved, moved_rows))
            steps.append((meta, pos))
        dstg.commit()
        return {"steps": steps, "graph": graph, "B": B, **self._stage_routes(stg, lay, rows, spec, K)}

    @staticmethod
    def _stage_routes(stg, lay, rows, spec, K) -> dict:
        """Where the drafts of the speculating requests `spec` come from and go (chains and
        trees alike): their device rows, their verify index, their root row in the target
        forward and the K draft rows after it."""
        root = [lay[i].row0 + lay[i].n_new - 1 for i in spec]
        return {"rows": stg.add([rows[i] for i in spec], torch.int64),
                "vidx": stg.add([lay[i].vi for i in spec], torch.int64),
                "root_rows": stg.add(root, torch.int64),
                "draft_rows": stg.add([[r + 1 + j for j in range(K)] for r in root], torch.int64)}

    def draft_chain(self, h: torch.Tensor, tok: torch.Tensor, steps) -> torch.Tensor:
        """K greedy draft forwards from (hidden, token) [B]; returns target-vocabulary drafts
        [B, K]. Captured as is by the draft CUDA graphs."""
        head = self.draft
        out = []
        for meta, pos in steps:
            with forward_context(ForwardContext(meta, self.backend, self.draft_cache)):
                logits, h = head(h, tok, pos)
            tok = head.to_target_ids(logits.argmax(-1))
            out.append(tok)
        return torch.stack(out, dim=1)

    def _run_chain(self, drafts, ids_d, N) -> torch.Tensor:
        """Draft the chains (a CUDA graph when one fits) and write the drafts into the target
        forward's input ids. Returns drafts [B, K]."""
        h = self.rows.draft_hidden[drafts["rows"].t]
        tok = ids_d[drafts["root_rows"].t]
        graph = drafts["graph"]
        if graph is not None:
            dt = graph.run(h, tok)[: drafts["B"]]
        else:
            dt = self.draft_chain(h, tok, drafts["steps"])
        ids_d[drafts["draft_rows"].t.reshape(-1)] = dt.reshape(-1)
        return dt

    # ---- tree drafting on the device --------------------------------------------------------
    def _stage_trees(self, stg, sched, lay, reqs, rows, moffs, shift=None) -> dict:
        """Stage the tree drafts of every speculating request (see `spec_decode.drafter`) and
        the indices that route the trees into the target forward and the verifier."""
        spec = [i for i, s in enumerate(sched) if s.draft is not None and lay[i].pad]
        N = 1 + lay[spec[0]].pad
        shapes = [sched[i].draft for i in spec]
        S = max(d.num_steps for d in shapes)
        graph = self.graphs.tree_graph(len(spec), S, N) if self.graphs is not None else None
        staged = self.tree_drafter.stage(self.draft_stg, [reqs[i] for i in spec], shapes, [rows[i] for i in spec],
                                         self.rows.block_table, pad_to=graph.batch if graph else 0,
                                         pad_row=self.rows.pad_row, shift=shift, slack=self.max_draft)
        return {"staged": staged, "graph": graph, "moff": stg.add(moffs, torch.int64),
                **self._stage_routes(stg, lay, rows, spec, N - 1)}

    def _run_trees(self, t, meta, ids_d, pos_d, vtok, vpar, vlim) -> None:
        """Draft the trees and write them where the step reads them: the target forward's
        ids, positions (root's + depth) and tree mask, and the verifier's tokens, parents and
        limits (each tree's own depth)."""
        root, moff = t["root_rows"].t, t["moff"].t
        h, tok = self.rows.draft_hidden[t["rows"].t], ids_d[root]
        if t["graph"] is not None:
            tr = t["graph"].run(h, tok)
        else:
            tr = self.tree_drafter.propose(t["staged"], h, tok, self.draft_cache)
        rows = t["draft_rows"].t
        ids_d[rows] = tr.tokens[:, 1:]
        pos_d[rows] = pos_d[root].unsqueeze(1) + tr.depths[:, 1:]
        N = tr.tokens.shape[1]
        at = moff.unsqueeze(1) + torch.arange(N * N, device=moff.device)
        meta.mask[at.reshape(-1)] = tr.mask.reshape(-1).to(torch.uint8)
        vi = t["vidx"].t
        vtok[vi] = tr.tokens
        vpar[vi] = tr.parents
        vlim[vi] = tr.depth

    # ---- committing -----------------------------------------------------------------------
    def _move_tree_kv(self, base, rows, path, count) -> None:
        """Accepted node path[d] was written at cache index base+path[d] (base [B] = the
        root's, n-1); its committed place is base+d. One gather/scatter over every layer's K
        and V; `rows` [B] are the requests' device rows."""
        D = path.shape[1] - 1
        if D == 0:
            return
        bs = self.block_size
        d = torch.arange(1, D + 1, device=self.device)
        src_idx = base.unsqueeze(1) + path[:, 1:]
        dst_idx = base.unsqueeze(1) + d.unsqueeze(0)
        move = (d.unsqueeze(0) < count.unsqueeze(1)) & (path[:, 1:] != d.unsqueeze(0))
        src_idx = torch.where(move, src_idx, dst_idx)
        table = self.rows.block_table[rows].long()

        def slot(idx):
            return table.gather(1, idx // bs) * bs + idx % bs

        src, dst = slot(src_idx).reshape(-1), slot(dst_idx).reshape(-1)
        self.kv[:, :, dst] = self.kv[:, :, src]

    def _refresh_arrays(self, sched, lay, reqs, D, pad, N) -> dict:
        """The draft-KV refresh, on the host: the pair (hidden_p, token_{p+1}) of every newly
        committed position p goes to draft slot p+1, for every request, speculating or not.
        A speculating request has one entry per accepted draft up to its own depth, or up to
        D when D is given (a post graph's fixed layout; entries past the accepted length write
        nothing); `pad` padding requests (of a graph batch, q = N rows each) add entries that
        write nothing."""
        base, dsel, vreq, emj, htok, dpos, dslot, last, lastadd = [], [], [], [], [], [], [], [], []
        q_lens = []
        moved, moved_rows = [], []      # refresh entries of requests whose previous step is in flight
        bs = self.block_size
        for i, (s, L) in enumerate(zip(sched, lay)):
            r, c = s.req, s.req.num_computed
            n = r.num_tokens
            blocks, toks = r.block_ids, r.all_token_ids
            vi = max(L.vi, 0)
            first = len(base)
            for j in range(L.n_new):
                p = c + j
                base.append(L.row0 + j)
                dsel.append(0)
                vreq.append(vi)
                known = p + 1 < n
                emj.append(-1 if known else 0)
                htok.append(toks[p + 1] if known else 0)
                dpos.append(p)
                dslot.append(blocks[(p + 1) // bs] * bs + (p + 1) % bs)
            if L.pad:   # the pairs of accepted drafts
                root = L.row0 + L.n_new - 1
                depth = L.depth if D is None else D
                for d in range(1, depth + 1):
                    p = n - 1 + d
                    base.append(root)
                    dsel.append(d)
                    vreq.append(L.vi)
                    emj.append(d)
                    htok.append(0)
                    dpos.append(p)
                    dslot.append(blocks[(p + 1) // bs] * bs + (p + 1) % bs if d <= L.depth else -1)
                last.append(len(base) - 1 - depth)
                lastadd.append(L.vi)
            else:
                last.append(len(base) - 1)
                lastadd.append(-1)
            q_lens.append(len(base) - first)
            if r.pending:
                moved.extend(range(first, len(base)))
                moved_rows.extend([r.row] * (len(base) - first))
        rows = [r.row for r in reqs]
        for e in range(pad):   # write nothing; `last` lands in the padding's own row
            vi = len(sched) + e
            for j in range(1 + (D or 0)):
                base.append(vi * N)
                dsel.append(0)
                vreq.append(vi)
                emj.append(-1)
                htok.append(0)
                dpos.append(0)
                dslot.append(-1)
            last.append(len(base) - 1)
            lastadd.append(-1)
            rows.append(self.rows.pad_row)
        if not base:
            return None
        return {"arr": np.array([base, dsel, vreq, emj, htok, dpos, dslot], dtype=np.int64),
                "last": np.array([last, lastadd], dtype=np.int64), "rows": rows, "q_lens": q_lens,
                "moved": moved, "moved_rows": moved_rows}

    def _refresh_meta(self, stg, pb, refresh, reqs, shift) -> None:
        """Register the refresh entries of in-flight requests with the shift and, for draft
        heads of more than one layer, stage the attention metadata of the refresh forward."""
        dpos, dslot = pb["refresh"]["arr"][5:7]
        moved = refresh["moved"]
        if shift is not None and moved:   # dslot is the slot of dpos + 1
            idx = np.asarray(moved, dtype=np.int64)
            shift.add(dpos, idx, refresh["moved_rows"])
            shift.add_slots(dslot, idx, dpos, idx, 1, refresh["moved_rows"])
        if self.draft.num_layers > 1:
            # Layers above the first attend: each request's pairs form a causal run of rows at
            # cache indices p + 1 (rows past the accepted length write nothing and no valid
            # row sees them). (No post graph: its steps are never padded.)
            q_lens = refresh["q_lens"]
            ends = np.cumsum(q_lens)
            pos = refresh["arr"][5]
            pb["refresh"]["meta"], _, _ = stage_forward(
                stg, self.backend, self.rows.block_table, self.block_size, self.draft_group, q_lens=q_lens,
                ctx_len=pos[ends - 1] + 2, kv_start=[1] * len(q_lens), req_row=[r.row for r in reqs],
                positions=pos, cache_index=pos + 1, slots=refresh["arr"][6])

    def _run_refresh(self, refresh, aux, path, emitted, count) -> None:
        base, dsel, vreq, emj, htok, dpos, dslot = (a.t for a in refresh["arr"])
        last, lastadd = refresh["last"].t
        row = base
        tok = htok
        if path is not None:
            row = base + torch.where(dsel > 0, path[vreq, dsel.clamp(max=path.shape[1] - 1)], 0)
            em = emitted[vreq, emj.clamp(min=0)]
            tok = torch.where(emj >= 0, em, htok)
            valid = (emj < 0) | (emj < count[vreq])
            dslot = torch.where(valid, dslot, torch.full_like(dslot, -1))
            last = last + torch.where(lastadd >= 0, count[lastadd.clamp(min=0)] - 1, 0)
        h = self.draft.project(aux[row])
        meta = refresh["meta"]
        if meta is None:
            self.draft.write_kv(h, tok, dpos, self.draft_cache, dslot)
        else:
            meta.slot_mapping.copy_(dslot)
            with forward_context(ForwardContext(meta, self.backend, self.draft_cache)):
                self.draft.write_kv(h, tok, dpos, self.draft_cache, dslot)
        self.rows.draft_hidden[refresh["rows"].t] = h[last]
