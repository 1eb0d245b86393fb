"""The device bitmask (`structured.bitmask.apply_bitmask`, plain tensor ops the post CUDA
graphs capture) masks exactly what xgrammar's own kernel masks."""
from __future__ import annotations

import pytest
import torch

from adaspec.structured.bitmask import apply_bitmask, bitmask_width

xgr = pytest.importorskip("xgrammar")


@pytest.mark.parametrize("vocab,width", [(64, 64), (77, 77), (77, 96), (1000, 1000), (31, 31)])
def test_apply_bitmask_equals_xgrammar(vocab, width):
    g = torch.Generator().manual_seed(vocab + width)
    R = 7
    mask = torch.randint(-2**31, 2**31 - 1, (R, bitmask_width(vocab)), dtype=torch.int32, generator=g)
    mask[2] = -1   # a row that allows everything
    mask[3] = 0    # ... and one that allows nothing
    logits = torch.randn(R, width, generator=g)
    ours, ref = logits.clone(), logits.clone()
    apply_bitmask(ours, mask, vocab)
    xgr.apply_token_bitmask_inplace(ref, mask, vocab_size=vocab)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[2], logits[2]) and torch.isinf(ours[3, :vocab]).all()
    bits = [(int(mask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    assert [bool(b) for b in bits] == torch.isfinite(ours[0, :vocab]).tolist()
