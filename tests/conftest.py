"""Shared fixtures: tiny random models (built once per session) and HF reference decoding."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Without a GPU, Triton kernels can only run under its interpreter, which Triton selects when a
# kernel is decorated (module import): set it before any test module imports one.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from adaspec.testing import make_tiny_model

ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral"]
NEAR_TIE = 1e-4


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {a: str(make_tiny_model(root / a, a)) for a in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def tok_model_dir(tmp_path_factory):
    """A tiny Llama with a byte-level BPE tokenizer and a chat template."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tokmodel") / "m", "llama", tokenizer=True))


_hf_cache: dict = {}


def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int):
    """transformers' own greedy generate: (tokens, per-step logits)."""
    from transformers import AutoModelForCausalLM

    key = (model_dir, tuple(prompt), max_new_tokens)
    if key not in _hf_cache:
        if model_dir not in _hf_cache:
            _hf_cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        m = _hf_cache[model_dir]
        out = m.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        toks = out.sequences[0, len(prompt):].tolist()
        _hf_cache[key] = (toks, [lg[0].float() for lg in out.logits])
    return _hf_cache[key]


def assert_matches_reference(got: list[int], ref: list[int], ref_logits: list[torch.Tensor], what: str = "") -> int:
    """Token-for-token equality; a divergence is tolerated only where the reference's top-2
    logits are within NEAR_TIE, and nothing after it is compared. Returns tokens compared."""
    n = min(len(got), len(ref))
    assert len(got) == len(ref), f"{what}: length {len(got)} != reference {len(ref)}"
    for i in range(n):
        if got[i] != ref[i]:
            top2 = ref_logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, f"{what}: token {i} is {got[i]}, reference {ref[i]} (top-2 gap {gap:.2e})\n got {got}\n ref {ref}"
            return i
    return n


@pytest.fixture(scope="session")
def agree_dir(tmp_path_factory):
    """A tiny Llama with a small init: its greedy continuations settle into loops and
    repeats that a one-layer draft head can learn in seconds (the default init is chaotic)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("agree") / "target", "llama", init_std=0.05))


@pytest.fixture(scope="session")
def trained_head_result(agree_dir, tmp_path_factory):
    """An EAGLE-3 head trained for 300 steps on `agree_dir`'s own greedy continuations: it
    partly agrees with the target and relies on its KV cache. (head dir, training result)"""
    from adaspec.train import train_eagle3_head

    out = tmp_path_factory.mktemp("trained") / "head"
    # Hard labels: the tiny target's distributions are flat, and greedy acceptance needs its argmax.
    result = train_eagle3_head(agree_dir, out, steps=300, seed=0, loss="hard", num_threads=1)
    return out, result


@pytest.fixture(scope="session")
def trained_head(trained_head_result):
    return str(trained_head_result[0])
