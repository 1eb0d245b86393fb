"""Draft shapes and draft trees: plain data, no model code.

A `DraftShape` is what the speculation policy hands the scheduler for a request: how many
draft forwards (`num_steps`), how many branches per forward (`topk`) and how many tokens the
target verifies including the root (`num_draft_tokens`), as in SGLang. A `DraftTree` is what
the drafter produced for one request: node 0 is the root (the last emitted token), parents
precede children, siblings are ordered best-first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, order=True)
class DraftShape:
    num_steps: int
    topk: int
    num_draft_tokens: int

    @classmethod
    def chain(cls, k: int) -> "DraftShape":
        return cls(num_steps=k, topk=1, num_draft_tokens=k + 1)

    @property
    def num_nodes(self) -> int:
        """Draft tokens verified (root excluded): the draft length the policy talks about."""
        return self.num_draft_tokens - 1

    @property
    def spec_slots(self) -> int:
        """KV slots past the root that this step may write: verified tree nodes (target) or
        frontier nodes of drafting steps 2..num_steps (draft), whichever is more."""
        return max(self.num_draft_tokens - 1, self.topk * (self.num_steps - 1))

    def capped(self, max_depth: int, max_nodes: int | None = None) -> "DraftShape | None":
        """The same shape limited to `max_depth` levels and, if given, to `max_nodes` draft
        tokens verified (root excluded; a path of n nodes is at most n deep). None when
        nothing is left; the shape itself when neither limit bites."""
        if max_nodes is not None and max_nodes < self.num_nodes:
            max_depth = min(max_depth, max_nodes)
        if max_depth < 1:
            return None
        shape = self
        if max_depth < self.num_steps:
            most = self.topk + (max_depth - 1) * self.topk * self.topk
            shape = DraftShape(max_depth, self.topk, min(self.num_draft_tokens, most + 1))
        if max_nodes is not None and max_nodes < shape.num_nodes:
            shape = DraftShape(shape.num_steps, shape.topk, max_nodes + 1)
        return shape

    def __str__(self) -> str:
        return f"chain{self.num_steps}" if self.topk == 1 else f"tree(s{self.num_steps},k{self.topk},n{self.num_draft_tokens})"


@dataclass
class DraftTree:
    tokens: list[int]    # [N] target-vocabulary ids; tokens[0] = root
    parents: list[int]   # [N] parent node index; parents[0] = -1
    depths: list[int]    # [N] depth; depths[0] = 0

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] = j is i or an ancestor of i (tree attention)."""
        n = self.size
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j] = True
                j = self.parents[j]
        return m


def request_shape(shape: DraftShape | None, speculate: bool, max_draft_tokens: int | None,
                  tokens_left: int) -> DraftShape | None:
    """One request's cap of the step's shape (the scheduler's `draft_budget`): None when it
    opts out (`speculate=False`); at most `max_draft_tokens` draft tokens verified, tree nodes
    included (SamplingParams.max_draft_tokens, as documented); no deeper than
    `tokens_left - 1`, since drafting past the last token it may emit is wasted work and KV."""
    if shape is None or not speculate:
        return None
    return shape.capped(tokens_left - 1, max_draft_tokens)
