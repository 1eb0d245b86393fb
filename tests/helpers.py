"""Helpers shared by the tests (fixtures live in conftest.py): tiny prompts, greedy sampling
parameters, and Hugging Face transformers' own greedy decoding as the reference."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from adaspec import SamplingParams

ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral"]
NEAR_TIE = 1e-4
MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """The script benchmarks/NAME.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prompts_of_lengths(lengths, seed=0, vocab=320):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


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


def chi2_sf(x: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(x / 2.0, dtype=torch.float64)))


def chi2_pvalue(counts: dict, expected: dict, n: int) -> float:
    """Pearson chi-square, cells with expected count < 5 pooled into one."""
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for k, p in expected.items():
        e = p * n
        if e < 5:
            pool_o += counts.get(k, 0)
            pool_e += e
        else:
            obs.append(counts.get(k, 0))
            exp.append(e)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return chi2_sf(stat, len(obs) - 1)


def check_against_hf(model_dir, prompts, outs, what):
    """Each output equal to transformers' greedy tokens (near-ties tolerated, `assert_matches_reference`)."""
    compared = 0
    for p, o in zip(prompts, outs):
        ref, logits = hf_greedy(model_dir, p, MAX_NEW)
        compared += assert_matches_reference(o.token_ids, ref, logits, what)
    assert compared > len(prompts) * MAX_NEW // 2, f"{what}: too few tokens compared ({compared})"


def two_token_expected(model_dir, prompt=(1, 5, 3, 2, 7), temp: float = 1.3, process=None) -> dict:
    """The target's p(t1) p(t2 | t1) by transformers, on a vocabulary of 8; `process(logits [V],
    prompt, output so far)` transforms the logits first (a reference's own implementation)."""
    from transformers import AutoModelForCausalLM

    prompt = list(prompt)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    proc = process or (lambda lg, _p, _o: lg)
    with torch.no_grad():
        l1 = hf(torch.tensor([prompt])).logits[0, -1]
        l2 = hf(torch.tensor([[*prompt, t] for t in range(8)])).logits[:, -1]
        p1 = torch.softmax(proc(l1.clone(), prompt, []) / temp, -1)
        p2 = torch.stack([torch.softmax(proc(l2[t].clone(), prompt, [t]) / temp, -1) for t in range(8)])
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(8) for b in range(8)}


def two_token_counts(model_dir, head_dir, n: int, prompt=(1, 5, 3, 2, 7), temp: float = 1.3, sampling=None,
                     grammars=None):
    """Speculative sampling (a tree of 4 over 2 steps), n copies of one prompt: ({(t1, t2):
    count}, the LLM, the outputs). The second token comes from a verify step. `sampling`:
    more SamplingParams fields; `grammars`: the engine's GrammarCache (a tokenizer-free
    vocabulary's, for `structured` requests)."""
    from adaspec import LLM

    llm = LLM(str(model_dir), draft=str(head_dir), speculation="always", num_steps=2, topk=2, num_draft_tokens=4,
              device="cpu", dtype="float32", seed=7)
    if grammars is not None:
        llm.engine.grammars = grammars
    outs = llm.generate([list(prompt)] * n, SamplingParams(max_tokens=3, temperature=temp, ignore_eos=True,
                                                           **(sampling or {})))
    counts: dict = {}
    for o in outs:
        k = tuple(o.token_ids[:2])
        counts[k] = counts.get(k, 0) + 1
    return counts, llm, outs


def two_token_law(model_dir, head_dir, n: int, prompt=(1, 5, 3, 2, 7), temp: float = 1.3):
    """(the chi-square p-value of `two_token_counts` against `two_token_expected`, the LLM):
    the law of speculative sampling against the target's."""
    counts, llm, _ = two_token_counts(model_dir, head_dir, n, prompt, temp)
    return chi2_pvalue(counts, two_token_expected(model_dir, prompt, temp), n), llm


def record_post_graphs(monkeypatch) -> list[tuple[bool, str | None]]:
    """Spy on `CudaGraphs.post_graph`: the returned list receives (refresh, extra) of every post
    graph a step looks up and finds (refresh True: the graph runs the draft refresh; extra None,
    "logprobs" or "grammar": `CudaGraphs.post_extras`)."""
    from adaspec.engine import cuda_graph

    seen: list[tuple[bool, str | None]] = []
    lookup = cuda_graph.CudaGraphs.post_graph

    def post_graph(self, target, depth, kind, refresh, extra=None):
        g = lookup(self, target, depth, kind, refresh, extra)
        if g is not None:
            seen.append((refresh, extra))
        return g

    monkeypatch.setattr(cuda_graph.CudaGraphs, "post_graph", post_graph)
    return seen


def kernel_path(path: str, monkeypatch) -> None:
    """Run the device floor's kernels through PyTorch ops ("torch") or their Triton kernels
    ("triton": the interpreter on CPU; skipped where Triton is missing or a GPU would run them)."""
    if path == "triton":
        if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
            pytest.skip("the Triton path runs here only under the CPU interpreter")
        monkeypatch.setenv("ADASPEC_TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("ADASPEC_TRITON_INTERPRET", raising=False)
