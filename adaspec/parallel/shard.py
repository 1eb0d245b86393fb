"""How the target is cut for tensor parallelism (Megatron's layout, as vLLM and SGLang use it):

    q/k/v, gate/up      column-parallel: rank r holds its query heads, the KV heads they read
                        (replicated when there are fewer KV heads than ranks) and its slice of
                        the intermediate size
    o, down             row-parallel: the matching input columns; the partial sums are added by
                        one all-reduce per attention and one per MLP (`DecoderLayer.tp_reduce`)
    experts (MoE)       each expert cut like a dense MLP (its own intermediate size), the router
                        and the shared-expert gate replicated: every rank routes identically.
                        With `expert_parallel` (vLLM's --enable-expert-parallel) rank r holds
                        whole experts instead, the contiguous run `experts(E)`; slots routed
                        to other ranks' experts add nothing there, and the MLP's all-reduce
                        sums the ranks' parts as it sums the cut experts' partial sums. Shared
                        experts and dense MLP layers are cut as above either way.
    embedding, LM head  vocabulary-parallel: rank r holds rows r*S .. (r+1)*S, S = ceil(V / N)
                        (the last shard padded with zero rows)
    norms               replicated

`Shard.local_spec` is the ModelSpec of one rank's model (so every module is built at its local
size by the ordinary code), `Shard.slice_of(checkpoint name)` the part of a checkpoint tensor
that rank reads: loading reads only that slice (`models.loader`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    expert_parallel: bool = False   # MoE: whole experts per rank instead of a cut of every expert

    # ---- the cut ------------------------------------------------------------------------
    def check(self, spec) -> None:
        """ValueError naming the dimension that `size` ranks cannot share."""
        n = self.size
        if n > 1 and (spec.o_bias or spec.mlp_bias):   # a row-parallel bias must be added once, after the sum
            raise ValueError(f"tensor_parallel_size={n}: checkpoints with `attention_bias` / `mlp_bias` biases on "
                             f"o_proj or the MLP are served on one GPU only")
        need = [("num_attention_heads", spec.num_heads), ("intermediate_size", spec.intermediate_size)]
        if spec.moe is not None:
            if not self.expert_parallel:
                need.append(("moe_intermediate_size", spec.moe.intermediate_size))
            elif spec.moe.router.num_experts < n:
                raise ValueError(f"tensor_parallel_size={n} with expert parallelism needs at least {n} experts, "
                                 f"the model has {spec.moe.router.num_experts}")
            if spec.moe.shared_intermediate_size:
                need.append(("shared expert intermediate size", spec.moe.shared_intermediate_size))
        for name, v in need:
            if v % n:
                raise ValueError(f"tensor_parallel_size={n} does not divide the model's {name}={v}")
        kv = spec.num_kv_heads
        if kv % n and n % kv:
            raise ValueError(f"tensor_parallel_size={n} and num_key_value_heads={kv}: one must divide the other "
                             f"(KV heads are split, or replicated when there are fewer than ranks)")

    def heads(self, spec) -> tuple[range, range]:
        """(query heads, KV heads) of this rank."""
        n, r = self.size, self.rank
        q = spec.num_heads // n
        if spec.num_kv_heads >= n:
            kv = spec.num_kv_heads // n
            return range(r * q, (r + 1) * q), range(r * kv, (r + 1) * kv)
        k0 = r * spec.num_kv_heads // n   # fewer KV heads than ranks: this rank's query heads read one
        return range(r * q, (r + 1) * q), range(k0, k0 + 1)

    def experts(self, num_experts: int) -> range:
        """Routed experts this rank holds whole under expert parallelism: a contiguous run, the
        first `num_experts % size` ranks one more (vLLM's linear placement)."""
        n, r = self.size, self.rank
        base, extra = divmod(num_experts, n)
        first = r * base + min(r, extra)
        return range(first, first + base + (r < extra))

    def vocab(self, vocab_size: int) -> range:
        """Vocabulary rows of this rank (the last shard may be short: padded with zero rows)."""
        s = -(-vocab_size // self.size)
        return range(min(self.rank * s, vocab_size), min((self.rank + 1) * s, vocab_size))

    def local_spec(self, spec):
        """The ModelSpec one rank's model is built from (its local sizes)."""
        self.check(spec)
        n = self.size
        q, kv = self.heads(spec)
        moe = spec.moe
        if moe is not None and self.expert_parallel:
            mine = self.experts(moe.router.num_experts)
            moe = replace(moe, local_experts=(mine.start, len(mine)),
                          shared_intermediate_size=moe.shared_intermediate_size // n)
        elif moe is not None:
            moe = replace(moe, intermediate_size=moe.intermediate_size // n,
                          shared_intermediate_size=moe.shared_intermediate_size // n)
        return replace(spec, num_heads=len(q), num_kv_heads=len(kv), intermediate_size=spec.intermediate_size // n,
                       vocab_size=-(-spec.vocab_size // n), moe=moe)

    # ---- what each rank reads -----------------------------------------------------------
    def holds(self, name: str, spec) -> bool:
        """Whether this rank reads checkpoint tensor `name` at all: under expert parallelism a
        routed expert's tensors (weights and FP8 scales) only on the rank holding that expert."""
        m = _EXPERT_INDEX.search(name) if self.expert_parallel and spec.moe is not None else None
        return m is None or int(m.group(1)) in self.experts(spec.moe.router.num_experts)

    def slice_of(self, name: str, spec) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor `name` this rank reads; None: all of it
        (under expert parallelism, a routed expert's tensors: the rank reads only its experts')."""
        for pattern, dim, unit in _RULES:
            if pattern.search(name):
                if unit == "expert" and self.expert_parallel:
                    return None
                lo, hi = self._units(unit, spec)
                return dim, lo, hi
        return None

    def _units(self, unit: str, spec) -> tuple[int, int]:
        q, kv = self.heads(spec)
        hd, n, r = spec.head_dim, self.size, self.rank
        if unit == "q":
            return q.start * hd, q.stop * hd
        if unit == "kv":
            return kv.start * hd, kv.stop * hd
        if unit == "vocab":
            v = self.vocab(spec.vocab_size)
            return v.start, v.stop
        width = {"inter": spec.intermediate_size, "expert": spec.moe.intermediate_size if spec.moe else 0,
                 "shared": spec.moe.shared_intermediate_size if spec.moe else 0}[unit] // n
        return r * width, (r + 1) * width


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")

# checkpoint-name pattern -> (dim cut, unit); the first match wins (experts before dense MLPs).
_RULES = [(re.compile(p), dim, unit) for p, dim, unit in (
    (r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$", 0, "expert"),
    (r"\.experts\.\d+\.(down_proj|w2)\.weight$", 1, "expert"),
    (r"\.shared_experts?\.(gate_proj|up_proj)\.weight$", 0, "shared"),
    (r"\.shared_experts?\.down_proj\.weight$", 1, "shared"),
    (r"\.mlp\.(gate_proj|up_proj)\.weight$", 0, "inter"),
    (r"\.mlp\.down_proj\.weight$", 1, "inter"),
    (r"\.q_proj\.(weight|bias)$", 0, "q"),
    (r"\.(k_proj|v_proj)\.(weight|bias)$", 0, "kv"),
    (r"\.o_proj\.weight$", 1, "q"),
    (r"(^|\.)(embed_tokens|lm_head)\.weight$", 0, "vocab"),
)]
