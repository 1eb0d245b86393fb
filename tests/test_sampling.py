"""adaspec/sampling.py: the law (vLLM's order of transforms) and its edge cases."""
from __future__ import annotations

import math

import torch

from adaspec import LLM, SamplingParams
from adaspec.sampling import SamplingBatch, choose, process_logits


def test_min_p_applies_before_top_p():
    """vLLM's order (issue 26 item 7): min-p first, then top-p over the renormalised rest.
    p = [0.4, 0.3, 0.2, 0.1], min_p 0.3 drops 0.1; top-p 0.75 then keeps two tokens (4/7, 3/7).
    Top-p first would have kept three (0.4 + 0.3 < 0.75)."""
    logits = torch.tensor([[math.log(x) for x in (0.4, 0.3, 0.2, 0.1)]])
    probs = process_logits(logits, [SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3)])[0]
    assert probs[2] == 0 and probs[3] == 0
    assert torch.allclose(probs[:2], torch.tensor([4 / 7, 3 / 7]), atol=1e-6)


def test_tiny_temperature_is_greedy(llama_dir):
    """Issue 23 item 6: a temperature far below float32's range gives the greedy tokens, not
    NaN probabilities; a top_p too small for float32 keeps the most likely token."""
    assert SamplingParams(temperature=1e-39).greedy
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    b = SamplingBatch.of([SamplingParams(temperature=0.7, top_p=1e-45)] * 3, [1, 2, 3], torch.device("cpu"))
    assert not torch.isnan(process_logits(logits, b)).any()
    assert torch.equal(choose(logits, b, torch.arange(3)), logits.argmax(-1))
    llm = LLM(llama_dir, device="cpu", dtype="float32")
    prompt = [[5, 9, 13, 2, 7]]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    tiny = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1e-39, ignore_eos=True))[0].token_ids
    assert tiny == greedy
