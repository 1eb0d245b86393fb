"""`max_draft_tokens` caps the draft tokens a request verifies, tree nodes included (issue 26
item 8; README: "max_draft_tokens"), not the depth: with the 16-token tree a cap of 2 used to
verify ~15 tokens per step."""
from __future__ import annotations

import pytest

from adaspec import LLM, SamplingParams
from adaspec.spec_decode.tree import request_shape
from adaspec.spec_decode.tree import DraftShape
from adaspec.testing import make_eagle3_head

TREE = DraftShape(num_steps=2, topk=4, num_draft_tokens=16)


def test_depth_caps_are_unchanged():
    """The policy's and the CUDA graphs' depth-capped candidates stay what they were."""
    assert TREE.capped(5) is TREE and TREE.capped(2) is TREE
    assert TREE.capped(1) == DraftShape(1, 4, 5) and TREE.capped(0) is None
    assert DraftShape.chain(4).capped(2) == DraftShape.chain(2)


@pytest.mark.parametrize("shape", [TREE, DraftShape(3, 2, 8), DraftShape.chain(4)])
def test_request_shape_caps_verified_tokens(shape):
    for cap in range(0, 20):
        got = request_shape(shape, True, cap, tokens_left=100)
        if cap == 0:
            assert got is None
            continue
        assert got.num_nodes == min(cap, shape.num_nodes) and got.num_steps <= min(cap, shape.num_steps)
        assert got.topk == shape.topk
    assert request_shape(shape, True, None, tokens_left=100) is shape
    assert request_shape(shape, False, None, tokens_left=100) is None
    assert request_shape(None, True, 2, tokens_left=100) is None
    # Tokens left bound the depth only (a path emits at most depth + 1 tokens).
    assert request_shape(shape, True, None, tokens_left=2) == shape.capped(1)
    assert request_shape(shape, True, None, tokens_left=1) is None


def test_tree_requests_verify_at_most_max_draft_tokens(llama_dir, tmp_path):
    """Each request's verified draft tokens per step, counted by the engine, stay within its
    own cap while the others verify the full tree; output is unchanged."""
    head = make_eagle3_head(tmp_path / "h", llama_dir)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44]]
    caps = [2, None, 5]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, max_draft_tokens=c) for c in caps]
    want = [o.token_ids for o in LLM(llama_dir, device="cpu", dtype="float32").generate(prompts, params)]
    llm = LLM(llama_dir, draft=str(head), speculation="always", num_steps=TREE.num_steps, topk=TREE.topk,
              num_draft_tokens=TREE.num_draft_tokens, device="cpu", dtype="float32")
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    for o, cap in zip(outs, caps):
        st = o.spec
        assert st["verify_steps"] > 0, st
        per_step = st["draft_tokens"] / st["verify_steps"]
        if cap is None:
            assert per_step > 5, st       # the uncapped request verifies (nearly) the whole tree
        else:
            assert per_step <= cap, st
