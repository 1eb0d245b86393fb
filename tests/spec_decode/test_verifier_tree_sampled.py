"""verifier.verify on sampled rows: the target's draw at each node (an exact sample of its law)
decides which child is accepted. Laws are checked on one request replicated many times in a
single batched call (CPU, seeded), against the per-tree host reference too."""
from __future__ import annotations

import torch

from adaspec.spec_decode import verifier
from adaspec.spec_decode.tree import DraftTree
from reference import verify_sampled

V = 6
# root; children 1 (token 0 = target's favourite), 2 (token 2), 3 (token 5 = least likely);
# grandchildren 4, 5 under 1 and 6 under 2; 7 is padding; 8 is a great-grandchild under 4.
TOKENS = [3, 0, 2, 5, 1, 3, 4, 0, 0]
PARENTS = [-1, 0, 0, 0, 1, 1, 2, -1, 4]
P_ROOT = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]


def tree_probs() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    p = torch.rand(len(TOKENS), V, generator=g) ** 2 + 0.02
    p[0] = torch.tensor(P_ROOT)
    p[7] = 0.0
    p[7, 0] = 1.0                     # padding: a token that would always be accepted
    return p / p.sum(1, keepdim=True)


def draws(probs: torch.Tensor, seed: int) -> torch.Tensor:
    """The target's choice at every node [B, N]: exponential race over probs [B, N, V]."""
    g = torch.Generator().manual_seed(seed)
    return (probs / torch.empty(probs.shape).exponential_(generator=g)).argmax(-1)


def run(tokens, parents, probs, limit, B, seed=0):
    """One request (tokens, parents [N], probs [N, V]) replicated B times, or a batch if
    tokens is already [B, N]. limit: int or [B]."""
    tokens, parents, probs = torch.as_tensor(tokens), torch.as_tensor(parents), torch.as_tensor(probs)
    if tokens.dim() == 1:
        tokens, parents, probs = (t.unsqueeze(0).expand(B, *t.shape) for t in (tokens, parents, probs))
    limit = torch.as_tensor(limit).expand(B).long()
    D = tokens.shape[1] - 1
    return verifier.verify(tokens, parents, limit, draws(probs, seed), D)


def freq(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.bincount(x, minlength=n).double() / max(len(x), 1)


def pairs(emitted, count):
    """(first, second) emitted tokens as one code; second = V when only one token came out."""
    second = torch.where(count > 1, emitted[:, 1], torch.full_like(count, V))
    return emitted[:, 0] * (V + 1) + second


def test_tree_law_first_and_second_token():
    probs = tree_probs()
    path, emitted, count = run(TOKENS, PARENTS, probs, limit=8, B=200_000)
    assert (freq(emitted[:, 0], V) - probs[0].double()).abs().max() < 0.006
    for c in (1, 2):                                   # accepted children with children
        sel = emitted[:, 0] == TOKENS[c]
        assert (path[sel, 1] == c).all() and (count[sel] >= 2).all()
        assert (freq(emitted[sel, 1], V) - probs[c].double()).abs().max() < 0.012
    # a first token that is no child's was a bonus: nothing follows it
    no_child = ~torch.isin(emitted[:, 0], torch.tensor([0, 2, 5]))
    assert (count[no_child] == 1).all() and (path[no_child] == 0).all()
    # third token after 1 -> 4 (the only depth-3 branch) follows probs[4]
    sel = path[:, 2] == 4
    assert (freq(emitted[sel, 2], V) - probs[4].double()).abs().max() < 0.02
    assert (path != 7).all()


def test_limit_caps_acceptance():
    probs = tree_probs()
    limit = torch.randint(0, 4, (200_000,), generator=torch.Generator().manual_seed(3))
    path, emitted, count = run(TOKENS, PARENTS, probs, limit, B=200_000, seed=4)
    assert (count <= limit + 1).all() and (count[limit == 0] == 1).all()
    depth = torch.arange(path.shape[1])
    assert (path[depth.unsqueeze(0) >= count.unsqueeze(1)] == 0).all()    # past the end: 0

    path, emitted, count = run(TOKENS, PARENTS, probs, limit=1, B=200_000, seed=5)
    assert (count <= 2).all() and (path[:, 2:] == 0).all()
    for c in (1, 2):                                   # the bonus after the child, from probs[c]
        sel = path[:, 1] == c
        assert (count[sel] == 2).all()
        assert (freq(emitted[sel, 1], V) - probs[c].double()).abs().max() < 0.012


def test_agrees_with_host_reference():
    probs = tree_probs()
    keep = [i for i in range(len(TOKENS)) if i != 7]   # the host tree has no padding
    remap = {old: new for new, old in enumerate(keep)}
    parents = [-1 if PARENTS[i] < 0 else remap[PARENTS[i]] for i in keep]
    depths = [0] * len(keep)
    for i in range(1, len(keep)):
        depths[i] = depths[parents[i]] + 1
    tree = DraftTree([TOKENS[i] for i in keep], parents, depths)
    g = torch.Generator().manual_seed(7)
    host = []
    for _ in range(10_000):
        nodes, bonus = verify_sampled(tree, probs[keep], g)
        out = [tree.tokens[n] for n in nodes] + [bonus]
        host.append(out[0] * (V + 1) + (out[1] if len(out) > 1 else V))
    path, emitted, count = run(TOKENS, PARENTS, probs, limit=8, B=200_000, seed=8)
    n = V * (V + 1)
    tv = 0.5 * (freq(torch.tensor(host), n) - freq(pairs(emitted, count), n)).abs().sum()
    assert tv < 0.05                                   # sampling noise here: about 0.02


def test_limit_zero_accepts_nothing():
    probs = tree_probs()
    path, emitted, count = run(TOKENS, PARENTS, probs, limit=0, B=100_000, seed=9)
    assert (count == 1).all() and (path == 0).all()
    assert (freq(emitted[:, 0], V) - probs[0].double()).abs().max() < 0.008


def test_certain_and_impossible_children():
    tokens, parents = [3, 1, 4, 2], [-1, 0, 0, 1]
    probs = torch.full((4, V), 1.0 / V)
    probs[0] = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])   # all mass on the 2nd child (token 4)
    path, emitted, count = run(tokens, parents, probs, limit=3, B=5000)
    assert (path[:, 1] == 2).all() and (count == 2).all() and (emitted[:, 0] == 4).all()

    probs[0] = torch.tensor([0.5, 0.0, 0.5, 0.0, 0.0, 0.0])   # no child's token has mass
    path, emitted, count = run(tokens, parents, probs, limit=3, B=20_000)
    assert (count == 1).all() and (path == 0).all()
    assert (freq(emitted[:, 0], V) - probs[0].double()).abs().max() < 0.02


def test_padding_never_accepted():
    # padding nodes (parent -1) carry the only token the target would ever emit
    tokens, parents = [3, 1, 4, 4, 4], [-1, 0, -1, 0, -1]
    probs = torch.zeros(5, V)
    probs[:, 4] = 1.0
    path, emitted, count = run(tokens, parents, probs, limit=4, B=5000)
    assert (path[:, 1] == 3).all() and (count == 2).all()
    assert not torch.isin(path, torch.tensor([2, 4])).any()
    assert (emitted[:, :2] == 4).all()


def test_duplicate_sibling_never_accepted():
    tokens, parents = [3, 1, 1], [-1, 0, 0]
    probs = torch.full((3, V), 0.1)
    probs[0, 1] = 0.5
    path, emitted, count = run(tokens, parents, probs, limit=2, B=50_000)
    assert (path[:, 1] != 2).all()
    assert abs((path[:, 1] == 1).double().mean() - 0.5) < 0.01
    assert (freq(emitted[:, 0], V) - probs[0].double()).abs().max() < 0.01


def test_chain_path_matches_the_tree_walk():
    """Chains (parents None: a few tensor ops) decide exactly as the walk does on the same draws."""
    B, K = 50_000, 3
    g = torch.Generator().manual_seed(11)
    tokens = torch.tensor([3, 0, 1, 2]).expand(B, K + 1)
    parents = torch.tensor([-1, 0, 1, 2]).expand(B, K + 1)
    probs = torch.rand(K + 1, V, generator=g) ** 2
    probs[:K, [0, 1, 2]] += 0.5                                 # drafts often accepted
    probs = (probs / probs.sum(1, keepdim=True)).expand(B, K + 1, V)
    limit = torch.randint(0, K + 1, (B,), generator=g)
    choice = draws(probs, 12)
    p1, e1, c1 = verifier.verify(tokens, parents, limit, choice, K)
    p2, e2, c2 = verifier.verify(tokens, None, limit, choice, K)
    assert torch.equal(c1, c2) and torch.equal(p1, p2)
    live = torch.arange(K + 1).unsqueeze(0) < c1.unsqueeze(1)
    assert torch.equal(e1[live], e2[live])
    assert len(c1.unique()) == K + 1                            # every outcome occurred


def test_mixed_batch():
    """Different trees and limits in one call, padded to N = 5; one-hot targets make every
    outcome deterministic."""
    P = -1
    tokens = torch.tensor([[3, 1, 4, 2, 0],      # 0: root -> 1 (p 0), 2 (p 1) -> 3 (p 1)
                           [3, 1, 4, 2, 0],      # 1: same tree, limit 1
                           [3, 1, 2, 0, 0],      # 2: chain of impossible drafts
                           [3, 4, 0, 0, 0],      # 3: certain child but limit 0
                           [3, 4, 4, 4, 4]])     # 4: root and padding only
    parents = torch.tensor([[-1, 0, 0, 2, P],
                            [-1, 0, 0, 2, P],
                            [-1, 0, 1, P, P],
                            [-1, 0, P, P, P],
                            [-1, P, P, P, P]])
    limit = torch.tensor([2, 1, 3, 0, 4])
    want = torch.tensor([[4, 0, 2, 5, 0],        # target's one-hot token at each node
                         [4, 0, 2, 5, 0],
                         [5, 5, 5, 0, 0],
                         [4, 0, 0, 0, 0],
                         [5, 4, 4, 4, 4]])
    probs = torch.nn.functional.one_hot(want, V).float()
    path, emitted, count = run(tokens, parents, probs, limit, B=5)
    assert count.tolist() == [3, 2, 1, 1, 1]
    assert path.tolist() == [[0, 2, 3, 0, 0], [0, 2, 0, 0, 0]] + [[0] * 5] * 3
    assert emitted[0, :3].tolist() == [4, 2, 5]
    assert emitted[1, :2].tolist() == [4, 2]
    assert emitted[2:, 0].tolist() == [5, 4, 5]


def test_no_host_sync():
    """Runs on the meta device, where any host read of a tensor value would raise."""
    B, N = 4, len(TOKENS)
    m = dict(device="meta")
    path, emitted, count = verifier.verify(
        torch.empty(B, N, dtype=torch.long, **m), torch.empty(B, N, dtype=torch.long, **m),
        torch.empty(B, dtype=torch.long, **m), torch.empty(B, N, dtype=torch.long, **m), N - 1)
    assert path.shape == emitted.shape == (B, N) and count.shape == (B,)
