"""Logprobs, penalties, logit_bias, min_tokens and n under speculation (issue 24): greedy
output with speculation (chains, trees, the threshold and auto policies crossing on and off,
overlap) equals plain decoding token for token, logprobs included; prompt logprobs equal
transformers'; n choices equal n = 1 with seed + i and share the prompt's KV."""
from __future__ import annotations

import pytest
import torch

from adaspec import LLM, SamplingParams
from helpers import prompts_of_lengths

CONFIGS = {
    "chain3": dict(speculation="always", num_steps=3, topk=1),
    "tree": dict(speculation="always", num_steps=2, topk=4, num_draft_tokens=8),
    "threshold5": dict(speculation="threshold", spec_disable_batch_size=5, num_steps=3, topk=1),
    "auto-tree": dict(speculation="auto", num_steps=2, topk=2, num_draft_tokens=5),
}
EOS = 1   # make_tiny_model's


def _prompts():
    return prompts_of_lengths([9, 4, 15, 6, 11, 3], seed=31)


def _params():
    """A mixed batch: plain rows next to penalized ones, logprobs on some (greedy)."""
    g = dict(temperature=0.0, ignore_eos=True)
    return [SamplingParams(max_tokens=16, logprobs=3, **g),
            SamplingParams(max_tokens=14, repetition_penalty=1.3, logprobs=0, **g),
            SamplingParams(max_tokens=16, frequency_penalty=0.4, presence_penalty=0.3, **g),
            SamplingParams(max_tokens=12, logit_bias={7: 2.0, 11: -5.0}, logprobs=2, **g),
            SamplingParams(max_tokens=10, min_tokens=4, temperature=0.0, logit_bias={EOS: 40.0}),
            SamplingParams(max_tokens=9, **g)]


@pytest.fixture(scope="module")
def reference(agree_dir):
    llm = LLM(agree_dir, device="cpu", dtype="float32", overlap=False)
    return llm.generate(_prompts(), _params())


def test_reference_penalties_act(agree_dir, reference):
    """The reference itself: the processors change the output, min_tokens holds EOS back."""
    llm = LLM(agree_dir, device="cpu", dtype="float32")
    plain = llm.generate(_prompts(), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for i in (1, 2, 3):
        assert reference[i].token_ids != plain[i].token_ids[:len(reference[i].token_ids)], i
    assert reference[4].token_ids == reference[4].token_ids[:4] + [EOS] and reference[4].finish_reason == "stop"
    assert EOS not in reference[4].token_ids[:4]
    lps = reference[0].logprobs
    assert len(lps) == 16 and all(len(top) == 3 and lp == pytest.approx(top[0][1]) for lp, top in lps)
    assert reference[1].logprobs is not None and all(top == () for _, top in reference[1].logprobs)
    assert reference[2].logprobs is None


@pytest.mark.parametrize("config", CONFIGS)
def test_greedy_with_speculation_equals_plain(agree_dir, trained_head, reference, config):
    llm = LLM(agree_dir, draft=trained_head, device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=24, **CONFIGS[config])
    outs = llm.generate(_prompts(), _params())
    for o, r in zip(outs, reference):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason
        assert (o.logprobs is None) == (r.logprobs is None)
        for (lp, top), (rlp, rtop) in zip(o.logprobs or [], r.logprobs or []):
            assert lp == pytest.approx(rlp, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in rtop]
            assert [v for _, v in top] == pytest.approx([v for _, v in rtop], abs=1e-4)
    st = llm.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]
    if CONFIGS[config]["speculation"] == "always":
        assert st["accepted_tokens"] > 0
    if config.startswith("threshold"):
        assert st["spec_steps"] > 0 and st["nonspec_steps"] > 0   # crossed


def test_n_choices_and_prompt_logprobs(agree_dir, trained_head):
    """n = 4 returns what n = 1 with seed + i returns, each speculating; the prompt's KV is
    computed once (prefix cache). Prompt logprobs equal transformers' log-softmax."""
    from transformers import AutoModelForCausalLM

    llm = LLM(agree_dir, draft=trained_head, speculation="always", num_steps=3, topk=1, device="cpu",
              dtype="float32", block_size=4)
    prompt = prompts_of_lengths([21], seed=31)[0]   # one the head drafts well
    sp = dict(max_tokens=10, temperature=0.9, ignore_eos=True)
    outs = llm.generate([prompt], SamplingParams(n=4, seed=40, logprobs=1, **sp))
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert len(outs) == 4 and hits >= 3 * 20
    singles = [llm.generate([prompt], SamplingParams(seed=40 + i, **sp))[0].token_ids for i in range(4)]
    assert [o.token_ids for o in outs] == singles and len({tuple(s) for s in singles}) > 1

    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2,
                                                logprobs=0))[0]
    hf = AutoModelForCausalLM.from_pretrained(agree_dir, dtype=torch.float32)
    seq = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        lp, top = out.prompt_logprobs[j]
        assert lp == pytest.approx(float(ref[j - 1, seq[j]]), abs=1e-4)
        assert [t for t, _ in top] == ref[j - 1].topk(2).indices.tolist()
    for j, (lp, _) in enumerate(out.logprobs):
        assert lp == pytest.approx(float(ref[len(prompt) - 1 + j, seq[len(prompt) + j]]), abs=1e-4)
    assert llm.stats()["accepted_tokens"] > 0
    with pytest.raises(ValueError, match="n=2"):
        llm.engine.add_request(None, prompt, SamplingParams(n=2))
