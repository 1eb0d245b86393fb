"""The device half of a step, named (`StepProgram`), and how it travels to the workers of a
tensor-parallel engine (`ProgramCodec`).

`ModelRunner._prepare` does the host work of a step once, on rank 0: it stages every input
into the step's staging buffers (one host->device copy each) and returns a StepProgram, the
objects the device half (`ModelRunner.execute_program`) reads: attention metadata, staged
views, the CUDA graphs to replay. Those objects are small and point into device state every
rank holds at the same layout (staging buffers, block tables, KV caches, captured graphs), so
the codec pickles them with each such reference written as a NAME (which buffer, offset,
shape, dtype; which graph) and resolved against the receiving rank's own state. The bytes of
the staging buffers follow by a broadcast on the device (`TPDriver.send`), not by pickle.
"""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

import torch

from adaspec.parallel.group import TPStartupError


@dataclass
class StepProgram:
    meta: object            # the target forward's AttnMeta
    ids: torch.Tensor       # its input ids (drafts are written into them on the device)
    pos: torch.Tensor       # its positions
    graph: object           # the target graph to replay, or None (eager)
    post: object            # the post graph to replay, or None
    vb: object              # verify_step.VerifyBatch
    verifies: bool          # some request samples this step
    upd: object             # staged block-table updates, or None
    fill: object            # staged (rows, device rows) of input tokens still on the device, or None
    chain: object           # draft_step.ChainBatch, or None
    trees: object           # draft_step.TreeBatch, or None
    shifts: list            # [(Shift, staged index arrays)]
    nbytes: int             # bytes staged in the step's buffer
    draft_nbytes: int       # ... and in the drafters' buffer (0: not used this step)
    prompt_lp: tuple | None = None   # (prompt logprob rows, top-k) of the step, or None
    rfill: object = None    # staged (refresh entries, device rows) whose pair token is still on the device
    grammar: object = None           # grammar_step.GrammarStep (rank 0 only: no grammar under TP), or None


def phase(tp, fn) -> None:
    """Run a start-up phase on this rank; with tensor parallelism, every rank then learns
    whether any failed (`TPGroup.exchange`), and all raise one error naming the failed ranks."""
    if tp is None:
        fn()
        return
    try:
        fn()
    except TPStartupError:   # already agreed on (a collective inside the phase saw it)
        raise
    except Exception as e:
        tp.exchange(error=f"{type(e).__name__}: {e}")   # raises, naming this rank
        raise
    tp.exchange()


class ProgramCodec:
    """StepProgram <-> bytes, against one runner's device state (see the module docstring)."""

    def __init__(self, runner):
        self.objects = {"stg": runner.stg, "draft_stg": runner.draft_stg}
        rows = runner.rows
        bases = {"stg": runner.stg.dev, "draft_stg": runner.draft_stg.dev, "block_table": rows.block_table,
                 "last_token": rows.last_token, "last_count": rows.last_count,
                 "last_emitted": rows.last_emitted, "draft_hidden": rows.draft_hidden,
                 "kv": runner.kv, "draft_kv": runner.draft_kv}
        self.bases = {k: v for k, v in bases.items() if v is not None}
        self.by_storage = {v.untyped_storage().data_ptr(): k for k, v in self.bases.items()}
        self.by_id = {id(v): k for k, v in self.objects.items()}
        graphs = runner.graphs
        self.graph_tables = graphs.tables() if graphs is not None else {}
        self.graph_ids = {id(g): (t, key) for t, table in self.graph_tables.items() for key, g in table.items()}
        self.views: dict[tuple, torch.Tensor] = {}

    def dumps(self, prog: StepProgram) -> bytes:
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        p.persistent_id = self._name
        p.dump(prog)
        return buf.getvalue()

    def loads(self, data: bytes) -> StepProgram:
        u = pickle.Unpickler(io.BytesIO(data))
        u.persistent_load = self._resolve
        return u.load()

    def _name(self, obj):
        if isinstance(obj, torch.Tensor):
            base = self.by_storage.get(obj.untyped_storage().data_ptr())
            if base is None:
                raise TypeError(f"a step program holds a tensor {tuple(obj.shape)} {obj.dtype} outside the "
                                f"device state every rank shares; stage it instead")
            return ("t", base, obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.dtype)
        key = self.by_id.get(id(obj))
        if key is not None:
            return ("o", key)
        g = self.graph_ids.get(id(obj))
        if g is not None:
            return ("g", *g)
        return None

    def _resolve(self, pid):
        kind = pid[0]
        if kind == "o":
            return self.objects[pid[1]]
        if kind == "g":
            return self.graph_tables[pid[1]][pid[2]]
        t = self.views.get(pid)
        if t is None:
            if len(self.views) >= 8192:   # layouts vary with the batch: keep the cache bounded
                self.views.clear()
            _, base, offset, shape, stride, dtype = pid
            b = self.bases[base]
            t = self.views[pid] = torch.empty(0, dtype=dtype, device=b.device).set_(
                b.untyped_storage(), offset, shape, stride)
        return t


def count_launches(counts, graph, post, verifies: bool, chain, trees) -> None:
    """Record how a launched step's parts run, as "<part>_graph" or "<part>_eager" counts in
    `counts` (Engine.stats "launches"): the target forward (`graph`: its CUDA graph or None),
    the post-forward where the step `verifies` (`post`: its graph or None), chain drafts and
    trees (None: the step has none)."""
    counts["target_graph" if graph is not None else "target_eager"] += 1
    if verifies:
        counts["post_graph" if post is not None else "post_eager"] += 1
    for name, part in (("chain", chain), ("tree", trees)):
        if part is not None:
            counts[f"{name}_graph" if part.graph is not None else f"{name}_eager"] += 1
