"""The model runner: executes a StepPlan on the device. It never decides what to run and never
allocates KV; it reads the block tables the scheduler prepared.

One step = [draft] -> target forward (prefill chunks, decodes and draft trees in one varlen
batch) -> sample / verify -> [move accepted tree KV into place] -> [refresh the draft KV].
"""
from __future__ import annotations

import torch

from adaspec.config import EngineConfig
from adaspec.engine.kv_cache import block_table_tensor, slot_of
from adaspec.engine.request import Request
from adaspec.engine.scheduler import StepPlan, StepResult
from adaspec.layers.attention import AttentionMetadata, get_backend
from adaspec.models.loader import load_model
from adaspec.sampling import process_logits, sample_from_probs
from adaspec.spec_decode.drafter import Drafter
from adaspec.spec_decode.tree import DraftTree
from adaspec.spec_decode.verify import simulate_acceptance, verify_greedy, verify_sampled

CPU_DEFAULT_KV_BYTES = 128 * 2**20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but CUDA is not available")
    return dev


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.model, self.spec, self.dtype = load_model(cfg.model, self.device, cfg.dtype, cfg.load_format, cfg.seed)
        self.backend = get_backend("torch")
        self.block_size = cfg.cache.block_size
        self.draft = None
        if cfg.spec.enabled:
            from adaspec.spec_decode.eagle3 import load_eagle3
            self.draft = load_eagle3(cfg.spec.draft, self.spec, self.model.embed_tokens, self.device,
                                     self.dtype, cfg.load_format, cfg.seed)
            self.drafter = Drafter(self.draft, self.backend, self.block_size, self.device)
        self.capture = self.draft.aux_layers if self.draft is not None else ()
        self.num_blocks = self._num_blocks()
        self.kv_caches = [self._alloc(self.spec.num_kv_heads, self.spec.head_dim) for _ in range(self.spec.num_layers)]
        # One (k, v) pair per draft layer (most heads have one layer).
        self.draft_cache = ([self._alloc(self.draft.spec.num_kv_heads, self.draft.spec.head_dim)
                             for _ in range(self.draft.num_layers)] if self.draft else None)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.sim_generator = torch.Generator().manual_seed(cfg.spec.simulate_seed)

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
                budget = int(free * c.gpu_memory_utilization) - 2 * 2**30  # leave room for activations
            else:
                budget = CPU_DEFAULT_KV_BYTES
        # No point holding more than every sequence slot at full length could use.
        useful = self.cfg.scheduler.max_num_seqs * (self.spec.max_position // self.block_size + 2)
        return max(1, min(budget // self.bytes_per_block(), useful))

    def _alloc(self, nkv: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_blocks * self.block_size, nkv, hd)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))

    # ---- helpers --------------------------------------------------------------------------
    def slot(self, req: Request, idx: int) -> int:
        return slot_of(req, idx, self.block_size)

    def _tensor(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def _block_tables(self, reqs: list[Request]) -> torch.Tensor:
        return block_table_tensor(reqs, self.device)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[StepResult]:
        sched = plan.scheduled
        trees: dict[int, DraftTree] = {}
        spec_idx = [i for i, s in enumerate(sched) if s.draft is not None]
        if spec_idx:
            proposed = self.drafter.propose([(sched[i].req, sched[i].draft) for i in spec_idx], self.draft_cache)
            trees = dict(zip(spec_idx, proposed))

        ids, pos, cidx, slots, qstart, ctx, masks = [], [], [], [], [0], [], []
        row0s, logit_rows = [], {}
        for i, s in enumerate(sched):
            r, c, L = s.req, s.req.num_computed, s.num_new_tokens
            row0 = len(ids)
            row0s.append(row0)
            ids += r.all_token_ids[c:c + L]
            pos += range(c, c + L)
            cidx += range(c, c + L)
            slots += [self.slot(r, p) if p >= r.no_kv_write_below else -1 for p in range(c, c + L)]
            tree = trees.get(i)
            if tree is None:
                ctx.append(c + L)
                masks.append(None)
            else:  # L == 1: the root is the last emitted token, at index n - 1
                n, N = r.num_tokens, tree.size
                ids += tree.tokens[1:]
                pos += [n - 1 + d for d in tree.depths[1:]]
                cidx += range(n, n - 1 + N)
                slots += [self.slot(r, n - 1 + j) for j in range(1, N)]
                m = torch.zeros(N, n - 1 + N, dtype=torch.bool)
                m[:, : n - 1] = True
                m[:, n - 1:] = tree.ancestor_mask()
                ctx.append(n - 1 + N)
                masks.append(m.to(self.device))
            qstart.append(len(ids))
            if s.samples:
                logit_rows[i] = [row0 + L - 1] + ([row0 + j for j in range(1, tree.size)] if tree else [])

        reqs = [s.req for s in sched]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots), query_start=qstart, context_lens=ctx, kv_start=[0] * len(sched),
            cache_index=self._tensor(cidx), block_tables=self._block_tables(reqs), custom_masks=masks,
            positions=self._tensor(pos))
        hidden, aux = self.model(self._tensor(ids), meta, self.kv_caches, self.backend, self.block_size, self.capture)

        results = [StepResult(emitted=[]) for _ in sched]
        if logit_rows:
            order = list(logit_rows)
            flat = [row for i in order for row in logit_rows[i]]
            logits = self.model.compute_logits(hidden[self._tensor(flat)])
            self._sample(sched, order, logit_rows, logits, trees, results)
        if trees:
            self._move_accepted_kv(sched, trees, results)
        if self.draft is not None:
            self._refresh_draft(sched, row0s, aux, results)
        return results

    def _sample(self, sched, order, logit_rows, logits, trees, results) -> None:
        """Plain rows are sampled in one batch; tree rows are verified per request."""
        offsets, k = {}, 0
        for i in order:
            offsets[i] = k
            k += len(logit_rows[i])
        plain = [i for i in order if i not in trees]
        if plain:
            rows = self._tensor([offsets[i] for i in plain])
            params = [sched[i].req.params for i in plain]
            if all(p.greedy for p in params):
                toks = logits[rows].argmax(dim=-1).tolist()
            else:
                probs = process_logits(logits[rows], params)
                toks = sample_from_probs(probs, [sched[i].req.generator for i in plain], self.generator).tolist()
            for i, t in zip(plain, toks):
                results[i].emitted = [t]
        sim = self.cfg.spec.simulate_accept_rate
        for i, tree in trees.items():
            req = sched[i].req
            rows = logits[offsets[i]: offsets[i] + tree.size]
            if sim is not None:
                path = simulate_acceptance(tree, sim, self.sim_generator)
                last = path[-1] if path else 0
                probs = process_logits(rows[last:last + 1], [req.params])
                bonus = int(sample_from_probs(probs, [req.generator], self.generator)[0])
            elif req.params.greedy:
                path, bonus = verify_greedy(tree, rows.argmax(dim=-1).tolist())
            else:
                probs = process_logits(rows, [req.params] * tree.size)
                path, bonus = verify_sampled(tree, probs, req.generator, self.generator)
            results[i] = StepResult(emitted=[tree.tokens[j] for j in path] + [bonus], num_accepted=len(path),
                                    tree_depth=tree.depth, tree_nodes=tree.size - 1, path=path)

    def _move_accepted_kv(self, sched, trees, results) -> None:
        """Accepted node j_i was written at index n-1+j_i; its committed place is n+i-1+1."""
        src, dst = [], []
        for i, tree in trees.items():
            r, n = sched[i].req, sched[i].req.num_tokens
            for depth, j in enumerate(results[i].path, start=1):
                if j != depth:
                    src.append(self.slot(r, n - 1 + j))
                    dst.append(self.slot(r, n - 1 + depth))
        if src:
            s, d = self._tensor(src), self._tensor(dst)
            for k, v in self.kv_caches:
                k[d] = k[s]
                v[d] = v[s]

    def _refresh_draft(self, sched, row0s, aux, results) -> None:
        """Write the draft KV of every newly committed pair (hidden_p, token_{p+1}) at slot
        p + 1, from the target's own hidden states, for every request, speculating or not.
        This keeps the draft cache exactly as fresh as the target's."""
        rows, next_tok, dpos, dslots, last_row, qstart = [], [], [], [], {}, [0]
        for i, s in enumerate(sched):
            r, c, L, res = s.req, s.req.num_computed, s.num_new_tokens, results[i]
            seq_next = r.all_token_ids[c + 1: c + L] + res.emitted[:1] if s.samples else r.all_token_ids[c + 1: c + L + 1]
            rows += range(row0s[i], row0s[i] + L)
            next_tok += seq_next
            dpos += range(c, c + L)
            dslots += [self.slot(r, p + 1) for p in range(c, c + L)]
            for d, j in enumerate(res.path, start=1):
                p = c + L - 1 + d
                rows.append(row0s[i] + j)
                next_tok.append(res.emitted[d])
                dpos.append(p)
                dslots.append(self.slot(r, p + 1))
            last_row[i] = len(rows) - 1
            qstart.append(len(rows))
        h = self.draft.project(aux[self._tensor(rows)])
        # Each request's rows are its new pairs in order, pair p at draft slot p + 1; a draft
        # layer above the first attends to slots 1..p+1 (a one-layer head only writes).
        meta = AttentionMetadata(slot_mapping=self._tensor(dslots), query_start=qstart,
                                 context_lens=[dpos[qstart[i + 1] - 1] + 2 for i in range(len(sched))],
                                 kv_start=[1] * len(sched), cache_index=self._tensor([p + 1 for p in dpos]),
                                 block_tables=self._block_tables([s.req for s in sched]),
                                 custom_masks=[None] * len(sched), positions=self._tensor(dpos))
        self.draft.write_kv(h, self._tensor(next_tok), meta, self.draft_cache, self.backend, self.block_size)
        for i, s in enumerate(sched):  # the next draft step starts from the last pair
            s.req.draft_hidden = h[last_row[i]].clone()
