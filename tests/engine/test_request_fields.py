"""vLLM's request fields beyond OpenAI's, on the demo pair (a real tokenizer, a head that is
accepted): bad_words, allowed_token_ids, include_stop_str_in_output and stop_reason,
skip_special_tokens, truncate_prompt_tokens. Every history-dependent one holds on verified
draft positions: greedy output with speculation (chains, trees, overlap) equals plain."""
from __future__ import annotations

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.demo import DEMO_HEAD, DEMO_TARGET, demo_available
from adaspec.penalties import PenaltyBatch, _history_tail, path_matrix

pytestmark = pytest.mark.skipif(not demo_available(), reason="the demo pair is not installed")

PROMPTS = ['def add(a, b):\n    """Add two numbers."""', "import os\nimport sys\n\ndef main():",
           "class Stack:\n    def push(self, x):"]
CONFIGS = {"off": dict(speculation="off"), "chain4": dict(speculation="always", num_steps=4),
           "tree": dict(speculation="always", num_steps=3, topk=3, num_draft_tokens=8),
           "chain4-no-overlap": dict(speculation="always", num_steps=4, overlap=False)}
GREEDY = dict(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def llms():
    return {k: LLM(str(DEMO_TARGET), draft=str(DEMO_HEAD), device="cpu", dtype="float32", **v)
            for k, v in CONFIGS.items()}


@pytest.fixture(scope="module")
def plain(llms):
    return llms["off"].generate(PROMPTS, SamplingParams(**GREEDY))


def _contains(seq: list[int], sub: tuple) -> bool:
    return any(tuple(seq[i:i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


def _same_everywhere(llms, params) -> list:
    """The outputs of every configuration, asserted equal to speculation off's."""
    ref = llms["off"].generate(PROMPTS, params)
    for name, llm in llms.items():
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], name
        assert [o.text for o in outs] == [o.text for o in ref], name
    assert llms["chain4"].stats()["accepted_tokens"] > 0
    return ref


def test_bad_words_ban_multi_token_words_losslessly(llms, plain):
    tok = llms["off"].tokenizer
    # Words the plain outputs write as 2-3 tokens, banned where their last token would complete them.
    words = []
    for o in plain:
        for i in range(10, len(o.token_ids) - 3, 7):
            text = tok.decode(o.token_ids[i:i + 3]).strip()
            if text and len(tok.encode(" " + text, add_special_tokens=False)) > 1:
                words.append(text)
    words = words[:6]
    assert len(words) >= 3
    outs = _same_everywhere(llms, SamplingParams(**GREEDY, bad_words=words))
    from adaspec.tokenization import bad_word_ids
    banned = bad_word_ids(tok, words)
    assert any(len(w) > 1 for w in banned)
    for o in outs:
        assert not any(_contains(o.token_ids, w) for w in banned)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]


def test_single_token_bad_word_and_allowed_ids(llms, plain):
    first = plain[0].token_ids[1]
    word = llms["off"].tokenizer.decode([first])
    outs = _same_everywhere(llms, SamplingParams(**GREEDY, bad_words=[word]))
    assert outs[0].token_ids[1] != first
    allowed = sorted(set(range(200, 700)) | {plain[1].token_ids[0]})
    outs = _same_everywhere(llms, SamplingParams(**GREEDY, allowed_token_ids=allowed))
    assert all(t in set(allowed) for o in outs for t in o.token_ids)
    assert outs[1].token_ids[0] == plain[1].token_ids[0]   # allowed and likeliest: kept


def test_include_stop_str_and_stop_reason(llms, plain):
    cut = llms["chain4"].generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, stop=["(a", "\n    "]))
    kept = llms["chain4"].generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, stop=["(a", "\n    "],
                                                           include_stop_str_in_output=True))
    for c, k in zip(cut, kept):
        assert c.finish_reason == k.finish_reason == "stop"
        assert k.stop_reason in ("(a", "\n    ") and c.stop_reason == k.stop_reason
        assert k.text == c.text + k.stop_reason
    stop_id = plain[0].token_ids[5]
    spelled = llms["off"].tokenizer.decode(plain[0].token_ids[:6])
    for include in (False, True):
        for cfg in ("off", "chain4"):
            out = llms[cfg].generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id],
                                                                 include_stop_str_in_output=include))[0]
            assert out.finish_reason == "stop" and out.stop_reason == stop_id and out.token_ids[-1] == stop_id
            want = spelled if include else llms["off"].tokenizer.decode(plain[0].token_ids[:5])
            assert out.text == want, (cfg, include)
    length = llms["off"].generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert length.finish_reason == "length" and length.stop_reason is None


def test_skip_special_tokens(llms):
    tok = llms["off"].tokenizer
    eos = tok.eos_token_id
    p = dict(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={eos: 100.0})
    skipped, kept = (llms["chain4"].generate(PROMPTS[0], SamplingParams(**p, skip_special_tokens=s))[0]
                     for s in (True, False))
    assert skipped.token_ids == kept.token_ids == [eos] * 6
    assert skipped.text == "" and kept.text == tok.eos_token * 6


def test_truncate_prompt_tokens(llms):
    ids = llms["off"].tokenizer.encode(PROMPTS[1])
    full = llms["off"].generate([ids[-4:]], SamplingParams(temperature=0.0, max_tokens=8))[0]
    cut = llms["chain4"].generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, truncate_prompt_tokens=4))[0]
    assert cut.prompt_token_ids == ids[-4:] and cut.token_ids == full.token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


@pytest.mark.parametrize("bad", [dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]), dict(bad_words=[""]),
                                 dict(include_stop_str_in_output=1), dict(skip_special_tokens="no")])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_allowed_ids_beyond_the_vocabulary_are_refused(llms):
    with pytest.raises(ValueError, match="allowed_token_ids: token id 99999 is out of range"):
        llms["off"].generate(PROMPTS[0], SamplingParams(allowed_token_ids=[5, 99999]))


def _reference_tail(out: list, recent: list, path: list, M: int) -> list:
    seq = out + recent + path
    tail = seq[-M:] if M else []
    return [-1] * (M - len(tail)) + tail


@pytest.mark.parametrize("tree", [False, True])
def test_history_tail_matches_a_host_reference(tree):
    """The device's per-node history window: host output, then the in-flight step's tokens
    (only where pending), then the node's draft path, for chains and trees."""
    g = torch.Generator().manual_seed(0)
    P, N, M, W = 3, 5, 4, 3
    tokens = torch.randint(10, 99, (P, N), generator=g)
    parents = torch.tensor([[-1, 0, 1, 0, 3], [-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]]) if tree else None
    anc = path_matrix(parents, P, N, 4, "cpu")
    outs = [[5, 6, 7, 8, 9], [4], []]
    tail = torch.tensor([_reference_tail(o, [], [], M) for o in outs])
    recent = torch.randint(100, 199, (P, W), generator=g)
    count = torch.tensor([2, 3, 1])
    pending = torch.tensor([True, False, True])
    z = torch.zeros(0)
    pb = PenaltyBatch(*([z] * 13), False, False, tail=tail)
    pb.pending = pending
    got = _history_tail(pb, tokens, anc, recent, count)
    for p in range(P):
        for i in range(N):
            path, k = [], i
            while k > 0:
                path.insert(0, int(tokens[p, k]))
                k = int(parents[p, k]) if tree else k - 1
            rec = recent[p, :count[p]].tolist() if pending[p] else []
            assert got[p, i].tolist() == _reference_tail(outs[p], rec, path, M), (p, i)


def test_detokenize_off_gives_token_ids_only(llms, plain):
    out = llms["chain4"].generate(PROMPTS, SamplingParams(**GREEDY, detokenize=False))
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert all(o.text is None for o in out)
    with pytest.raises(ValueError, match="detokenize=False cannot be combined with stop"):
        SamplingParams(detokenize=False, stop=["x"])


def test_a_bad_word_too_long_is_refused(llms):
    from adaspec.tokenization import MAX_BAD_WORD_TOKENS

    word = " ".join(f"w{i}" for i in range(MAX_BAD_WORD_TOKENS))
    with pytest.raises(ValueError, match="bad_words: .* tokens, more than the limit"):
        llms["off"].generate(PROMPTS[0], SamplingParams(bad_words=[word]))


def test_penalty_histories_beyond_the_staging_buffer(llms, monkeypatch):
    """Histories that do not fit the step's staging buffer (many penalized requests with long
    prompts) are copied on their own: the same output, where the step used to fail."""
    import random

    from adaspec.device import staging

    def prompts(seed):
        rng = random.Random(seed)
        return [[rng.randrange(3, 8000) for _ in range(600)] for _ in range(4)]

    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                        allowed_token_ids=list(range(6000)), bad_words=["return"])
    want = [o.token_ids for o in llms["off"].generate(prompts(2), sp)]
    stg = llms["chain4"].engine.runner.stg
    used = []
    commit = staging.Staging.commit
    monkeypatch.setattr(staging.Staging, "commit",
                        lambda self: (used.append(self.offset) if self is stg else None, commit(self))[1])
    llms["chain4"].generate(prompts(1), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    monkeypatch.setattr(staging.Staging, "commit", commit)   # (what the steps themselves stage: max(used))
    full, stg.nbytes = stg.nbytes, max(used) + (1 << 17)   # room for them, not for ~0.5 MB of histories
    try:
        assert [o.token_ids for o in llms["chain4"].generate(prompts(2), sp)] == want
    finally:
        stg.nbytes = full
