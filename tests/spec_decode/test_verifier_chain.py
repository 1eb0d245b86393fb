"""Chains verified in a few tensor ops (parents None) give exactly what the general tree walk
gives on chains, for every limit, real and simulated verification."""
from __future__ import annotations

import pytest
import torch

from adaspec.spec_decode import simulated, verifier


@pytest.mark.parametrize("D", [1, 3, 5])
def test_chain_verifiers_equal_the_tree_walk(D):
    g = torch.Generator().manual_seed(D)
    B = 400
    argmax = torch.randint(0, 3, (B, D + 1), generator=g)
    tokens = torch.randint(0, 3, (B, D + 1), generator=g)
    agree = torch.rand(B, D, generator=g) < 0.8                 # drafts that match the target's choice
    tokens[:, 1:] = torch.where(agree, argmax[:, :-1], tokens[:, 1:])
    limit = torch.randint(0, D + 1, (B,), generator=g)
    parents = torch.arange(-1, D).expand(B, D + 1).clone()
    parents[limit == 0] = -1      # rows that do not speculate carry no tree at all
    uniforms = torch.rand(B, D, generator=g) < 0.7
    for got, want in (
        (verifier.verify(tokens, None, limit, argmax, D), verifier.verify(tokens, parents, limit, argmax, D)),
        (simulated.simulate(tokens, None, limit, argmax, uniforms, D),
         simulated.simulate(tokens, parents, limit, argmax, uniforms, D)),
    ):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    count = verifier.verify(tokens, None, limit, argmax, D)[2]
    assert (count <= limit + 1).all() and len(set(count.tolist())) == D + 1   # every length occurs
