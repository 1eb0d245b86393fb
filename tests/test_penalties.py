"""History-dependent sampling (`adaspec.penalties`): each verified node is penalized by the
output plus the draft tokens on its path (a host reference written independently), and
sampled speculation with penalties follows the penalized target's law."""
from __future__ import annotations

import torch

from adaspec.penalties import PenaltyBatch, apply_penalties, path_matrix
from adaspec.testing import make_eagle3_head, make_tiny_model
from helpers import chi2_pvalue, two_token_counts, two_token_expected


def reference(logits, prompt, history, pres, freq, rep, bias, min_tokens, stops):
    """vLLM's order on one row, written loop by loop: bias, min_tokens, repetition, frequency, presence."""
    lg = logits.clone()
    for t, b in bias.items():
        lg[t] += b
    if len(history) < min_tokens:
        for t in stops:
            lg[t] = float("-inf")
    for t in set(prompt) | set(history):
        lg[t] = lg[t] / rep if lg[t] > 0 else lg[t] * rep
    for t in set(history):
        lg[t] -= freq * history.count(t) + pres
    return lg


def node_path(tokens, parents, i: int) -> list[int]:
    """The draft tokens from the root to node i (itself included), by following parents."""
    path = []
    while i > 0:
        path.insert(0, int(tokens[i]))
        i = int(parents[i])
    return path


def node_histories(tokens, parents, out, recent, rcount, pending):
    """(request, node, the node's whole history) for every node: the host output, the in-flight
    step's tokens where pending, then the draft path (`parents` None: chains)."""
    par = torch.arange(-1, tokens.shape[1] - 1).expand_as(tokens) if parents is None else parents
    for b in range(tokens.shape[0]):
        base = out[b] + (recent[b, :rcount[b]].tolist() if pending[b] else [])
        for i in range(tokens.shape[1]):
            yield b, i, base + node_path(tokens[b], par[b], i)


def pairs(rows_tokens):
    return torch.tensor(rows_tokens, dtype=torch.long).reshape(-1, 2).T


def test_nodes_count_their_path():
    """Two requests, a tree (with a padding node) and a chain, one with an in-flight previous
    step (`pending`): every node's processed logits equal the host reference's after
    (host output + in-flight tokens + the node's path)."""
    torch.manual_seed(0)
    V, N = 11, 5
    tokens = torch.tensor([[4, 3, 5, 3, 0], [2, 6, 6, 1, 9]])
    parents_tree = torch.tensor([[-1, 0, 0, 1, -1], [-1, 0, 1, 2, 3]])   # row 0: node 4 pads; row 1: a chain
    prompt = [[1, 2, 3], [7, 8]]
    out = [[5, 5, 9], [2]]                 # output tokens known on the host
    recent, rcount, pending = torch.tensor([[7, 4, 0], [3, 0, 0]]), torch.tensor([2, 1]), [False, True]
    pres, freq, rep = [0.3, 0.0], [0.5, 1.1], [1.4, 1.0]
    bias, min_tokens, stops = [{2: 1.5}, {}], [0, 6], [[], [9, 1]]
    logits = torch.randn(2, N, V)
    pb = PenaltyBatch(
        rows=torch.tensor([0, 1]), presence=torch.tensor(pres), frequency=torch.tensor(freq),
        repetition=torch.tensor(rep), min_tokens=torch.tensor(min_tokens),
        out_len=torch.tensor([len(o) for o in out]), pending=torch.tensor(pending),
        hist=pairs([(j, t) for j, o in enumerate(out) for t in set(o)]),
        hist_val=torch.tensor([float(o.count(t)) for o in out for t in set(o)]),
        prompt=pairs([(j, t) for j, p in enumerate(prompt) for t in set(p)]),
        bias=pairs([(0, 2)]), bias_val=torch.tensor([1.5]), stops=pairs([(1, 9), (1, 1)]),
        use_repetition=True, use_min_tokens=True)
    for parents in (parents_tree, None):   # a tree, then the same tokens as two chains
        got = apply_penalties(logits, pb, tokens, path_matrix(parents, 2, N, 4, logits.device), recent, rcount)
        for b, i, hist in node_histories(tokens, parents, out, recent, rcount, pending):
            want = reference(logits[b, i], prompt[b], hist, pres[b], freq[b], rep[b], bias[b], min_tokens[b], stops[b])
            assert torch.allclose(got[b, i], want, atol=1e-5), (parents is None, b, i, got[b, i], want)
    assert torch.isinf(got[1, 0, 9]) and not torch.isinf(got[1, 4, 9])   # min_tokens lifts along the path


def test_sampled_speculation_with_penalties_follows_the_law(tmp_path):
    """End to end on a vocabulary of 8: with repetition, frequency and presence penalties and a
    logit bias, the joint law of the first two tokens (the second one from a verify step whose
    drafts know nothing of penalties) is the penalized target's. False-alarm rate 1e-3."""
    d = make_tiny_model(tmp_path / "v8", "llama", vocab_size=8, init_std=0.1, eos_token_id=None)
    head = make_eagle3_head(tmp_path / "h8", d)
    sampling = dict(repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4, logit_bias={3: 0.8})

    def process(lg, prompt, out):
        return reference(lg, prompt, out, 0.4, 0.7, 1.6, {3: 0.8}, 0, [])

    n = 2000
    counts, llm, _ = two_token_counts(d, head, n, sampling=sampling)
    st = llm.stats()
    assert st["verify_steps"] >= n and 0 < st["accepted_tokens"] < st["draft_tokens"]
    assert chi2_pvalue(counts, two_token_expected(d, process=process), n) > 1e-3
    # The test has power: the same draws are far from the unpenalized law.
    assert chi2_pvalue(counts, two_token_expected(d), n) < 1e-6


def test_bad_words_and_allowed_ids_at_every_node():
    """allowed_token_ids and bad words (single and multi-token; a prefix that straddles the host
    output, the in-flight step's tokens and the draft path) against a host reference of each
    node's full history, for a tree and the same tokens as chains."""
    torch.manual_seed(1)
    V, N = 12, 5
    tokens = torch.tensor([[4, 3, 5, 3, 6], [2, 6, 6, 1, 9]])
    parents_tree = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]])
    out = [[5, 7, 4], [2]]
    recent, rcount, pending = torch.tensor([[1, 1, 0], [8, 2, 0]]), torch.tensor([1, 2]), [False, True]
    words = [[(4, 3, 7), (9,), (3, 5)], [(2, 6, 11), (6, 6, 1), (8, 2, 2)]]   # per row: token sequences
    allowed = [None, [0, 1, 2, 6, 9, 11]]
    M = max(len(w) for ws in words for w in ws) - 1
    prefix, last, rows = [], [], []
    for j, ws in enumerate(words):
        for w in ws:
            rows.append(j)
            last.append(w[-1])
            prefix.append([-2] * (M - len(w) + 1) + list(w[:-1]))
    tail = torch.tensor([[-1] * (M - len(o[-M:])) + o[-M:] for o in out])
    z = torch.zeros(2)
    pb = PenaltyBatch(
        rows=torch.tensor([0, 1]), presence=z, frequency=z, repetition=torch.ones(2), min_tokens=torch.zeros(2).long(),
        out_len=torch.tensor([len(o) for o in out]), pending=torch.tensor(pending),
        hist=pairs([(j, t) for j, o in enumerate(out) for t in set(o)]),
        hist_val=torch.tensor([float(o.count(t)) for o in out for t in set(o)]),
        prompt=pairs([]), bias=pairs([]), bias_val=torch.zeros(0), stops=pairs([]),
        use_repetition=False, use_min_tokens=False,
        allow=pairs([(1, t) for t in allowed[1]]), restricted=torch.tensor([False, True]),
        bad_row=torch.tensor(rows), bad_prefix=torch.tensor(prefix), bad_last=torch.tensor(last), tail=tail)
    logits = torch.randn(2, N, V)
    banned_somewhere = False
    for parents in (parents_tree, None):   # a tree, then the same tokens as two chains
        got = apply_penalties(logits, pb, tokens, path_matrix(parents, 2, N, 4, logits.device), recent, rcount)
        for b, i, hist in node_histories(tokens, parents, out, recent, rcount, pending):
            want = logits[b, i].clone()
            if allowed[b] is not None:
                want[[t for t in range(V) if t not in allowed[b]]] = float("-inf")
            for w in words[b]:
                if len(w) == 1 or tuple(hist[-(len(w) - 1):]) == w[:-1]:
                    want[w[-1]] = float("-inf")
                    banned_somewhere |= len(w) > 1
            assert torch.equal(got[b, i], want), (parents is None, b, i, hist)
    assert banned_somewhere
