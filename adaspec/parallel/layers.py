"""The layers of a sharded model that talk to the other ranks.

    VocabParallelEmbedding   rows of rank r's vocabulary shard; other ids look up zeros; one
                             all-reduce makes the full embedding on every rank (exact: one
                             addend is non-zero)
    VocabParallelHead        logits of rank r's shard; one all-gather of ONLY the rows it is
                             given (the runner gives the rows that sample or are verified)
    parallelize(model, ...)  swaps them into a model built from `Shard.local_spec` and loaded,
                             and gives every decoder layer its all-reduce (row-parallel o and
                             down / experts: `DecoderLayer.tp_reduce`)

Both keep their parameter named `weight`, so checkpoint names and tied embeddings are unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.parallel.group import TPGroup
from adaspec.parallel.shard import Shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: nn.Parameter, rows: range, tp: TPGroup):
        super().__init__()
        self.weight = weight                    # [S, H]; rows past len(rows) are zero padding
        self.start, self.stop, self.tp = rows.start, rows.stop, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (ids >= self.start) & (ids < self.stop)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out = out.masked_fill(~mine.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def matches(self, full: torch.Tensor, same) -> bool:
        """Whether `full` [V, H] equals the embedding this shard is part of, as `same(a, b)`
        judges, on every rank (all ranks return the same answer)."""
        n = self.stop - self.start
        ok = full.shape[1:] == self.weight.shape[1:] and full.shape[0] >= self.stop and \
            same(full[self.start:self.stop], self.weight[:n])
        return all(self.tp.exchange(bool(ok)))


class VocabParallelHead(nn.Module):
    def __init__(self, weight: nn.Parameter, vocab_size: int, tp: TPGroup):
        super().__init__()
        self.weight = weight                    # [S, H], shared with the embedding when tied
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R, V]: the same logits on every rank."""
        logits = self.tp.all_gather_last(F.linear(hidden, self.weight))
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., : self.vocab_size].contiguous()   # the last shard's padding rows off


def parallelize(model: nn.Module, full_spec, shard: Shard, tp: TPGroup) -> nn.Module:
    """Make a loaded local model (built from `shard.local_spec(full_spec)`) one rank of the
    full model. Call after `fuse()` or before: fusing touches neither the embedding nor the head."""
    rows = shard.vocab(full_spec.vocab_size)
    embed = VocabParallelEmbedding(model.embed_tokens.weight, rows, tp)
    head = VocabParallelHead(model.lm_head.weight, full_spec.vocab_size, tp)
    model.embed_tokens, model.lm_head = embed, head
    for layer in model.layers:
        layer.tp_reduce = tp.all_reduce
    return model
