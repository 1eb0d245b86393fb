"""The device tree selection (`spec_decode.drafter.select`) against a plain host reference of
SGLang's rule: keep the best num_draft_tokens - 1 candidates by score (ties: the earlier
candidate), order them by depth then score; padding past a request's own budget."""
from __future__ import annotations

import random

import pytest
import torch

from adaspec.spec_decode.drafter import cap_of_candidates, select
from adaspec.spec_decode.tree import DraftTree


def _candidates(rng: random.Random, k: int, S: int, own_steps: int, ties: bool):
    """Candidates as a drafter makes them: k at depth 1, then k children for each of the k best
    of the previous depth; a child scores at most its parent."""
    def logp():
        return -rng.choice([0.5, 1.0, 2.0]) if ties else -rng.random() * 3

    tok, score, parent, depth = [], [], [], []
    for _ in range(k):
        tok.append(rng.randrange(1000))
        score.append(logp())
        parent.append(-1)
        depth.append(1)
    level = list(range(k))
    for d in range(2, S + 1):
        frontier = sorted(level, key=lambda c: (-score[c], c))[:k]
        level = []
        for f in frontier:
            for _ in range(k):
                level.append(len(tok))
                tok.append(rng.randrange(1000))
                score.append(score[f] + logp() if d <= own_steps else float("-inf"))
                parent.append(f)
                depth.append(d)
    return tok, score, parent, depth


def _reference(tok, score, parent, depth, root, n_keep, N) -> DraftTree:
    best = sorted(range(len(score)), key=lambda c: (-score[c], c))[:n_keep]
    keep = sorted(best, key=lambda c: (depth[c], -score[c], c))
    index = {c: i + 1 for i, c in enumerate(keep)}
    pad = N - 1 - len(keep)
    return DraftTree([root] + [tok[c] for c in keep] + [0] * pad,
                     [-1] + [index[parent[c]] if parent[c] >= 0 else 0 for c in keep] + [-1] * pad,
                     [0] + [depth[c] for c in keep] + [0] * pad)


@pytest.mark.parametrize("k,S,N", [(4, 2, 16), (2, 3, 8), (3, 3, 10), (1, 3, 4)])
@pytest.mark.parametrize("ties", [False, True])
def test_select_matches_reference(k, S, N, ties):
    rng = random.Random(k * 100 + S * 10 + N + ties)
    B = 12
    rows, refs, own_nodes = [], [], []
    for b in range(B):
        own_steps = S if b % 3 else rng.randint(1, S)      # some requests capped shallower
        most = k + (own_steps - 1) * k * k
        n_keep = min(N - 1, most) if b % 4 else rng.randint(1, min(N - 1, most))
        tok, score, parent, depth = _candidates(rng, k, S, own_steps, ties)
        assert len(tok) == cap_of_candidates(k, S)
        root = rng.randrange(1000)
        rows.append((tok, score, parent, root))
        refs.append(_reference(tok, score, parent, depth, root, n_keep, N))
        own_nodes.append(n_keep)
    t = select(torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
               torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows]),
               torch.tensor(own_nodes), k, S, N)
    for b, ref in enumerate(refs):
        n = own_nodes[b] + 1
        assert t.tokens[b].tolist() == ref.tokens
        assert t.parents[b].tolist() == ref.parents
        assert t.depths[b].tolist() == ref.depths
        assert int(t.depth[b]) == max(ref.depths)
        real = DraftTree(ref.tokens[:n], ref.parents[:n], ref.depths[:n])
        assert torch.equal(t.mask[b, :n, :n], real.ancestor_mask())
        assert not t.mask[b, :n, n:].any()
        # Padding nodes see the root only.
        assert t.mask[b, n:, 0].all() and not t.mask[b, n:, 1:].any()


def test_tree_contains_the_chain_and_accepts_at_least_as_much(agree_dir, trained_head):
    """A tree that keeps every candidate (topk 2, 2 steps: 2 + 4 nodes) contains the chain of
    the same depth (its best depth-1 node and that node's best child), so with a trained head
    its acceptance is at least the chain's. A wrong hidden row, mask or position for the
    second depth shows up here as a collapse of depth-2 acceptance."""
    from adaspec import LLM, SamplingParams
    from helpers import prompts_of_lengths

    prompts = prompts_of_lengths([6, 11, 17, 4, 9], seed=31)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    stats = {}
    for name, shape in (("chain", dict(num_steps=2, topk=1)), ("tree", dict(num_steps=2, topk=2, num_draft_tokens=7))):
        llm = LLM(agree_dir, draft=trained_head, speculation="always", device="cpu", dtype="float32", **shape)
        llm.generate(prompts, sp)
        stats[name] = llm.stats()
    chain, tree = stats["chain"], stats["tree"]
    assert chain["accept_rate_per_position"][1] > 0.2, chain   # the head does reach depth 2
    assert tree["accept_length"] >= chain["accept_length"], (tree["accept_length"], chain["accept_length"])
    assert tree["accept_rate_per_position"][1] >= 0.9 * chain["accept_rate_per_position"][1], (tree, chain)
