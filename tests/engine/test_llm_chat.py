"""`LLM.chat` (vLLM's offline chat): conversations rendered by the chat template, then generate."""
from __future__ import annotations

import pytest

from adaspec import LLM, SamplingParams
from adaspec.tokenization import encode_chat


def test_llm_chat_equals_generate_on_the_template(tok_model_dir, tok_head_dir):
    llm = LLM(tok_model_dir, draft=tok_head_dir, speculation="always", device="cpu", dtype="float32")
    assert llm.get_tokenizer() is llm.tokenizer
    one = [{"role": "user", "content": "hi"}]
    two = one + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.chat([one, two], sp)
    want = llm.generate([encode_chat(llm.tokenizer, c) for c in (one, two)], sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert outs[0].prompt_token_ids == encode_chat(llm.tokenizer, one)
    assert llm.chat(one, sp)[0].token_ids == outs[0].token_ids           # one conversation
    cont = llm.chat(two[:2], sp, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt_token_ids == encode_chat(llm.tokenizer, two[:2], {"add_generation_prompt": False,
                                                                         "continue_final_message": True})
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat([], sp)
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(one, sp, continue_final_message=True)


def test_vllm_keywords_accepted_or_refused_by_name(llama_dir):
    llm = LLM(llama_dir, device="cpu", trust_remote_code=True, disable_log_stats=True, swap_space=4, quantization=None,
              revision=None, enable_chunked_prefill=True, kv_cache_dtype="auto", tokenizer_mode="auto", max_logprobs=20)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    for bad in (dict(trust_remote_code="yes"), dict(quantization="awq"), dict(revision="main"),
                dict(enable_chunked_prefill=False), dict(kv_cache_dtype="fp8"), dict(max_logprobs=50)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LLM(llama_dir, device="cpu", **bad)


def test_vllm_dict_prompts(tok_model_dir):
    llm = LLM(tok_model_dir, device="cpu", dtype="float32")
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode("The quick brown fox")
    want = llm.generate(["The quick brown fox", ids], sp)
    got = llm.generate([{"prompt": "The quick brown fox"}, {"prompt_token_ids": ids}], sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.generate({"prompt_token_ids": ids}, sp)[0].token_ids == want[1].token_ids
    with pytest.raises(ValueError, match="exactly one of"):
        llm.generate([{"prompt": "x", "prompt_token_ids": ids}], sp)


def test_vllm_style_outputs_view(llama_dir):
    llm = LLM(llama_dir, device="cpu", dtype="float32")
    o = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, logprobs=1, ignore_eos=True))[0]
    c = o.outputs[0]
    assert (c.index, c.token_ids, c.finish_reason, c.stop_reason) == (0, o.token_ids, "length", None)
    assert c.cumulative_logprob == pytest.approx(sum(lp for lp, _ in o.logprobs))
    assert LLM(llama_dir, device="cpu").generate([[1, 2]], SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None
