"""The device bitmask (`structured.bitmask.apply_bitmask`, plain tensor ops the post CUDA
graphs capture) masks exactly what xgrammar's own kernel masks."""
from __future__ import annotations

import pytest
import torch

from adaspec.structured import StructuredOutput
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


def _allowed(row: torch.Tensor, vocab: int) -> list[int]:
    return [t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1]


@pytest.mark.parametrize("tree", [False, True])
def test_simulated_acceptance_legalizes_forbidden_drafts(tree):
    """Benchmarks' simulated acceptance (`step_bitmask(..., legalize=True)`): each forbidden
    draft on the path simulation takes (a chain, a tree's first children) becomes the allowed
    token nearest it, the masks follow the replaced tokens, the matcher ends where it began;
    without legalize the same drafts are left alone and their rows allow everything."""
    import numpy as np

    from adaspec.structured.bitmask import step_bitmask
    from adaspec.structured.grammar import GrammarCache

    cache = GrammarCache.from_vocab(list("abcdefgh"), stop_token_ids=[7])
    grammar = cache.matcher(StructuredOutput("regex", "[a-d][b-g][c-e]"))
    # chain root, h, a, b; the tree adds a second child of the root (g) after the first (h)
    tokens = np.array([[0, 7, 0, 1, 6]]) if tree else np.array([[0, 7, 0, 1]])
    parents = np.array([[-1, 0, 1, 2, 0]]) if tree else None
    N = tokens.shape[1]
    out = torch.empty(N, bitmask_width(8), dtype=torch.int32)
    plain = tokens.copy()
    assert not step_bitmask(out, [grammar], N, plain, parents, np.array([3]))
    assert plain.tolist() == tokens.tolist() and _allowed(out[1], 8) == list(range(8))   # h: forbidden, unreached
    assert step_bitmask(out, [grammar], N, tokens, parents, np.array([3]), legalize=True)
    assert tokens[0, :4].tolist() == [0, 3, 1, 2]          # h -> d, a -> b, b -> c: nearest allowed ids
    assert [_allowed(out[i], 8) for i in range(4)] == [[0, 1, 2, 3], [1, 2, 3, 4, 5, 6], [2, 3, 4], [7]]
    if tree:
        assert tokens[0, 4] == 6   # a later sibling is never taken by simulation: left as drafted
    assert grammar.accept(2) and not grammar.done   # the matcher is back at the start: 'c' is a first token


@pytest.mark.parametrize("vocab", [8, 77, 1000, 4099])
def test_nearest_allowed_token_equals_a_search_over_every_token(vocab):
    """The legalize walk's word-by-word search finds what a search over the unpacked row
    finds: the nearest allowed token below `vocab`, the lower one on a tie, -1 when none; over
    dense, sparse, one-word and empty rows, bits past `vocab` set or not."""
    import numpy as np

    from adaspec.structured.bitmask import nearest_allowed

    rng = np.random.default_rng(vocab)
    W = bitmask_width(vocab)
    checked = 0
    for density in (0.0, 0.001, 0.02, 0.5, 0.97):
        for _ in range(40):
            bits = rng.random(W * 32) < density
            if density == 0.001 and rng.random() < 0.5:   # all allowed tokens in one word
                bits[:] = False
                w = rng.integers(W)
                bits[w * 32: w * 32 + 32] = rng.random(32) < 0.3
            row = np.packbits(bits, bitorder="little").view(np.int32).copy()
            allowed = [a for a in range(vocab) if bits[a]]
            for t in rng.integers(0, vocab, 6).tolist() + [0, vocab - 1]:
                want = min(allowed, key=lambda a: (abs(a - t), a)) if allowed else -1
                assert nearest_allowed(row, t, vocab) == want, (density, t)
                checked += 1
    assert checked == 5 * 40 * 8


def test_simulated_acceptance_does_not_depend_on_a_random_heads_legality(tok_model_dir, tok_head_dir):
    """With simulated acceptance a request with a grammar accepts drafts about as often as one
    without (a random head's drafts are mostly illegal: it accepted a third as many before its
    forbidden drafts were replaced), and its JSON still validates; chains and trees."""
    import json

    import jsonschema

    from adaspec import LLM, SamplingParams

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    for kw in ({"num_steps": 3}, {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}):
        llm = LLM(tok_model_dir, draft=tok_head_dir, speculation="always", device="cpu", dtype="float32",
                  spec_simulate_accept_rate=0.8, **kw)
        rates = []
        for structured in (None, StructuredOutput.json_schema(schema)):
            before = llm.stats()
            outs = llm.generate(["Hello"] * 8, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=structured is None,
                                                              structured=structured))
            after = llm.stats()
            rates.append((after["accepted_tokens"] - before["accepted_tokens"])
                         / (after["verify_steps"] - before["verify_steps"]))
        assert rates[1] > 0.8 * rates[0], (kw, rates)
        for o in outs:
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), schema)
