"""CUDA checks (skipped without a GPU): the same lossless guarantees on the device, and a
dummy-weight run of a Llama-3.1-8B shape through the whole step loop."""
from __future__ import annotations

import json

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.testing import make_eagle3_head, make_tiny_model

from helpers import record_post_graphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Every tiny model and head these tests use, written before any engine runs. (On the
    H200 image, building a transformers model with random init after a CUDA-graph engine had
    run in the same process failed inside torch's CUDA RNG ("Offset increment outside graph
    capture"); engine outputs were unaffected. Writing the models first keeps the tests
    about the engine.)"""
    root = tmp_path_factory.mktemp("gpu_models")
    out = {}
    for arch in ("llama", "qwen3", "mistral"):
        d = make_tiny_model(root / arch, arch, hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)
        out[arch] = (d, make_eagle3_head(root / f"{arch}-head", d, draft_vocab_size=200))
    return out


@pytest.mark.parametrize("pdl", ["0", "1"])
def test_cuda_greedy_lossless_chain_and_tree(models, monkeypatch, pdl):
    """Lossless with programmatic dependent launch forced off and on (a tiny model alone
    would choose it off: layers/pdl.py), every kernel, graph and eager path of the step."""
    monkeypatch.setenv("ADASPEC_PDL", pdl)
    d, h = models["llama"]
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ref = LLM(str(d), device="cuda", dtype="float32", max_num_seqs=16).generate(prompts, sp)
    for shape in (dict(num_steps=3, topk=1), dict(num_steps=8, topk=1), dict(num_steps=2, topk=4, num_draft_tokens=16)):
        llm = LLM(str(d), draft=str(h), speculation="always", device="cuda", dtype="float32", max_num_seqs=16,
                  **shape)
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        st = llm.stats()
        assert st["num_free_blocks"] == st["num_total_blocks"] and st["verify_steps"] > 0
        assert st["pdl"] == (pdl == "1" and torch.cuda.get_device_capability()[0] >= 9)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_cuda_graphs_and_triton_match_torch_reference(models, arch):
    """Triton attention with CUDA graphs (padded buckets), Triton eager and the torch reference
    backend give the same greedy tokens, with and without speculation (fp32)."""
    d, h = models[arch]
    prompts = [[(11 * i + 5 * j) % 300 + 3 for j in range(3 + 7 * i)] for i in range(5)]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    base = dict(device="cuda", dtype="float32", block_size=16, max_num_seqs=16)   # fewer graphs to capture
    ref = [o.token_ids for o in LLM(str(d), attention_backend="torch", enforce_eager=True, **base).generate(prompts, sp)]
    accepted = {}   # the drafts (eager or replayed from a drafter graph) are the same too
    for kw in (dict(attention_backend="torch", enforce_eager=True), dict(attention_backend="triton", enforce_eager=True),
               dict(attention_backend="triton")):
        assert [o.token_ids for o in LLM(str(d), **kw, **base).generate(prompts, sp)] == ref, kw
        for shape in (dict(num_steps=3, topk=1), dict(num_steps=2, topk=4, num_draft_tokens=8)):
            llm = LLM(str(d), draft=str(h), speculation="always", **shape, **kw, **base)
            assert [o.token_ids for o in llm.generate(prompts, sp)] == ref, (kw, shape)
            st = llm.stats()
            assert st["num_free_blocks"] == st["num_total_blocks"]
            accepted.setdefault(shape["topk"], []).append(st["accepted_tokens"])
            if "enforce_eager" not in kw:
                g = llm.engine.runner.graphs
                assert (len(g.tree_graphs) > 0) == (shape["topk"] > 1) and len(g.draft_graphs) > 0
    assert all(len(set(v)) == 1 for v in accepted.values()), accepted
    graphs = LLM(str(d), attention_backend="triton", **base).engine.runner.graphs
    assert graphs is not None and len(graphs.graphs) > 0


def test_cuda_post_graphs_equal_eager(models, monkeypatch):
    """Verification and commit replayed as post graphs (greedy and simulated acceptance) give
    the tokens and acceptance of the same work run eagerly, with padded batches."""
    from adaspec.engine import cuda_graph

    d, h = models["llama"]
    prompts = [[(5 * i + 11 * j) % 300 + 3 for j in range(4 + 6 * i)] for i in range(5)]
    sp = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 40, 23, 31, 5)]
    replays = []
    replay = cuda_graph._PostGraph.replay
    monkeypatch.setattr(cuda_graph._PostGraph, "replay", lambda self: replays.append(1) or replay(self))
    base = dict(device="cuda", dtype="float32", block_size=16, max_num_seqs=8)
    for shape in (dict(num_steps=3, topk=1), dict(num_steps=2, topk=4, num_draft_tokens=8)):
        for sim in (None, 0.7):
            got = {}
            for eager in (True, False):
                replays.clear()
                llm = LLM(str(d), draft=str(h), speculation="always", enforce_eager=eager,
                          spec_simulate_accept_rate=sim, **shape, **base)
                toks = [o.token_ids for o in llm.generate(prompts, sp)]
                st = llm.stats()
                assert st["num_free_blocks"] == st["num_total_blocks"]
                assert (len(replays) > 0) == (not eager), (shape, sim, eager)
                got[eager] = (toks, st["accepted_tokens"], st["verify_steps"])
            assert got[True] == got[False], (shape, sim)


def test_cuda_speculation_off_at_zero_cost(models, monkeypatch):
    """Issue 27 on the device, CUDA graphs on: requests that opt out replay the post graphs
    without the draft refresh (all of them) or write nothing in them (some), and a threshold
    that flips off and on catches the drafts up (eager catch-up steps, then graph steps):
    greedy output equals speculation off every time, and verification still runs."""
    d, h = models["llama"]
    prompts = [[(5 * i + 11 * j) % 300 + 3 for j in range(4 + 6 * i)] for i in range(6)]
    base = dict(device="cuda", dtype="float32", block_size=16, max_num_seqs=8)
    seen = record_post_graphs(monkeypatch)
    sp = [SamplingParams(max_tokens=24 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    ref = [o.token_ids for o in LLM(str(d), **base).generate(prompts, sp)]
    for name, speculate, kw in (("idle", [False] * 6, dict(speculation="always")),
                                ("some", [True, False] * 3, dict(speculation="always")),
                                ("threshold", [True] * 6, dict(speculation="threshold", spec_disable_batch_size=3))):
        seen.clear()
        llm = LLM(str(d), draft=str(h), num_steps=3, topk=1, **kw, **base)
        params = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True, speculate=s)
                  for p, s in zip(sp, speculate)]
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref, name
        st = llm.stats()
        refreshed = [r for r, _ in seen]
        assert refreshed, name
        if name == "idle":
            assert st["verify_steps"] == 0 and not any(refreshed)
        else:
            assert st["verify_steps"] > 0 and any(refreshed), (name, st)


def test_cuda_prompts_replay_token_graphs(models):
    """Prompts served one at a time, and all at once (prompt chunks beside decodes and chains),
    replay token graphs (real CUDA graphs, Triton attention with a padded launch plan): the
    same tokens as eager steps, with speculation off, a chain and simulated acceptance,
    chunked prompts included; no target step runs eagerly."""
    d, h = models["llama"]
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(n)] for i, n in enumerate([1, 9, 16, 17, 63, 128, 200])]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = dict(device="cuda", dtype="float32", block_size=16, max_num_seqs=4, max_num_batched_tokens=128)
    for kw in ({}, dict(draft=str(h), speculation="always", num_steps=3, topk=1),
               dict(draft=str(h), speculation="always", num_steps=3, topk=1, spec_simulate_accept_rate=0.7)):
        outs = {}
        for eager in (True, False):
            llm = LLM(str(d), enforce_eager=eager, long_prefill_token_threshold=32, **kw, **base)
            if not eager:
                g = llm.engine.runner.graphs
                assert list(g.token_graphs) == [16, 32, 64, 128], kw   # they all pay here
                # the stats (and the serving line) count every kind the start-up log counts
                kinds = (g.graphs, g.token_graphs, g.draft_graphs, g.tree_graphs, g.post_graphs)
                assert llm.stats()["cuda_graphs"] == sum(map(len, kinds)), kw
            outs[eager] = [llm.generate([p], sp)[0].token_ids for p in prompts] + \
                [o.token_ids for o in llm.generate(prompts, sp)]
            launches = llm.stats()["launches"]
        assert outs[False] == outs[True], kw
        assert launches.get("target_eager", 0) == 0 and launches["target_graph"] > 0, launches


def test_cuda_no_kernel_compiles_while_serving(models):
    """After start-up (graph capture and warm-up), prompts of new lengths in batches of new
    sizes, with speculation, compile no Triton kernel variant: no JIT stall while serving."""
    from adaspec.device import shift_kernels
    from adaspec.layers import fused_ops
    from adaspec.layers.attention import triton_kernels as tk

    kernels = [tk._paged_attn_kernel, tk._split_reduce_kernel, fused_ops._rms_norm_kernel,
               fused_ops._silu_and_mul_kernel, fused_ops._rotary_qkv_store_kernel,
               shift_kernels._shift_kernel]
    if not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton keeps its kernel caches elsewhere")

    def variants():
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    d, h = models["llama"]
    llm = LLM(str(d), draft=str(h), speculation="always", num_steps=3, device="cuda", dtype="float32",
              max_num_seqs=8)
    before = variants()
    for n, lens in ((1, [37]), (3, [5, 90, 13]), (5, [3, 7, 150, 21, 66]), (7, [9] * 7)):
        prompts = [[(3 * i + 5 * j) % 300 + 3 for j in range(m)] for i, m in enumerate(lens)]
        llm.generate(prompts, SamplingParams(max_tokens=12 + n, temperature=0.0, ignore_eos=True))
    assert variants() == before


def test_cuda_matches_transformers(models):
    """Greedy tokens with graphs on equal transformers' own generate on the same GPU (fp32)."""
    from transformers import AutoModelForCausalLM

    d = models["llama"][0]
    prompts = [[(5 * i + 3 * j) % 300 + 3 for j in range(4 + 9 * i)] for i in range(4)]
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).cuda().eval()
    ref = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    got = LLM(str(d), device="cuda", dtype="float32", max_num_seqs=16).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == ref


def test_cuda_8b_shape_dummy_weights(tmp_path):
    """Real Llama-3.1-8B shapes with random weights: the engine runs every policy."""
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 128256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    head = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "draft_vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(head))
    prompts = [[(13 * i + j) % 128000 for j in range(128)] for i in range(16)]
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for policy in ("off", "always", "auto"):
        llm = LLM(str(tmp_path / "t"), draft=str(tmp_path / "d"), speculation=policy, load_format="dummy",
                  device="cuda", dtype="bfloat16", num_steps=3, spec_simulate_accept_rate=0.8,
                  kv_cache_memory=8 * 2**30)
        outs = llm.generate(prompts, sp)
        assert all(len(o.token_ids) == 32 for o in outs)
        st = llm.stats()
        assert st["num_free_blocks"] == st["num_total_blocks"]
        if policy == "always":
            assert 2.5 < st["accept_length"] < 4.0
        del llm
        torch.cuda.empty_cache()


def test_cuda_overlap_changes_nothing(models):
    """With CUDA graphs on, overlap (step N+1 launched before step N is read back) gives the
    same tokens as one step at a time: greedy under every policy, seeded sampling, requests
    that finish mid-flight, a small KV pool (preemption)."""
    d, h = models["llama"]
    prompts = [[(3 * i + 7 * j) % 300 + 3 for j in range(6 + 5 * i)] for i in range(8)]
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 5, 33, 2, 17, 40, 9, 24)]
    base = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=24, max_num_seqs=16)
    ref = [o.token_ids for o in LLM(str(d), overlap=False, **base).generate(prompts, greedy)]
    for kw in ({}, dict(speculation="always", num_steps=3), dict(speculation="always", num_steps=2, topk=4,
                                                                  num_draft_tokens=8),
               dict(speculation="auto", num_steps=3)):
        for overlap in (True, False):
            llm = LLM(str(d), overlap=overlap, **(dict(draft=str(h)) if kw else {}), **kw, **base)
            assert [o.token_ids for o in llm.generate(prompts, greedy)] == ref, (kw, overlap)
            st = llm.stats()
            assert st["num_free_blocks"] == st["num_total_blocks"]
            assert (st["overlapped_steps"] > 0) == overlap, (kw, st["overlapped_steps"])
    # Seeded sampling is reproducible in each mode. Across modes it is equal without a draft;
    # with drafts, overlap changes which rows share a GEMM (a request that finished while its
    # next step was planned still fills rows), and a last-bit difference in a probability can
    # flip a draw, so across overlap modes only the law is asserted here (the draws themselves
    # are counter-based: test_cuda_seeded_output_independent_of_speculation checks equality).
    sampled = [SamplingParams(max_tokens=20, temperature=0.9, top_k=50, seed=i, ignore_eos=True) for i in range(8)]
    a = [o.token_ids for o in LLM(str(d), overlap=True, **base).generate(prompts, sampled)]
    b = [o.token_ids for o in LLM(str(d), overlap=False, **base).generate(prompts, sampled)]
    assert a == b
    tree = dict(draft=str(h), speculation="always", num_steps=2, topk=4, num_draft_tokens=8, overlap=True)
    a = [o.token_ids for o in LLM(str(d), **tree, **base).generate(prompts, sampled)]
    b = [o.token_ids for o in LLM(str(d), **tree, **base).generate(prompts, sampled)]
    assert a == b and [len(t) for t in a] == [20] * 8


def test_cuda_seeded_output_independent_of_speculation(models):
    """Issue 23 item 4 on the GPU, graphs and overlap on: a seeded sampled request gives the
    same tokens without speculation, with chains of 1 and 3 and with a tree, alone and inside a
    batch (fp32: the counter-based draws compare probabilities, not bits of a GEMM)."""
    d, h = models["llama"]
    prompt = [(7 * j) % 300 + 3 for j in range(12)]
    others = [[(3 * i + 5 * j) % 300 + 3 for j in range(4 + 3 * i)] for i in range(7)]
    sp = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)
    base = dict(device="cuda", dtype="float32", block_size=16, max_num_seqs=16)
    outs = {}
    for name, kw in {"off": {}, "chain1": dict(num_steps=1), "chain3": dict(num_steps=3),
                     "tree": dict(num_steps=2, topk=4, num_draft_tokens=8)}.items():
        llm = LLM(str(d), **(dict(draft=str(h), speculation="always", **kw) if kw else {}), **base)
        outs[name] = llm.generate([prompt], sp)[0].token_ids
        res = llm.generate(others[:3] + [prompt] + others[3:],
                           [SamplingParams(max_tokens=32, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)]
                           + [sp] + [SamplingParams(max_tokens=32, temperature=0.8, ignore_eos=True)] * 4)
        outs[name + "-batch"] = res[3].token_ids
    assert len({tuple(v) for v in outs.values()}) == 1, outs


def test_cuda_grammar_with_speculation_equals_off(models):
    """Grammar requests on the device (forward graphs, pinned draft readback, xgrammar's CUDA
    mask kernel) mixed with free ones: greedy equal to speculation off, chains and trees, and
    every constrained output obeys its grammar (tokens are single characters of a raw vocabulary),
    with penalties, logit_bias and logprobs in the same request too."""
    pytest.importorskip("xgrammar")
    from adaspec.structured import StructuredOutput
    from adaspec.structured.grammar import GrammarCache

    d, h = models["llama"]
    pieces = [chr(0x4E00 + i) for i in range(320)]
    spec = StructuredOutput("regex", "[" + "".join(pieces[i] for i in range(320) if i % 3) + "]*")
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, structured=spec if i % 2 else None)
              for i in range(5)]
    # grammar, penalties and logprobs in one request (mask after the penalties, raw logprobs)
    params.append(SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, structured=spec,
                                 repetition_penalty=1.3, logit_bias={4: 2.0}, logprobs=3))
    runs = {}
    for name, kw in {"off": {}, "chain": dict(draft=str(h), speculation="always", num_steps=3),
                     "tree": dict(draft=str(h), speculation="always", num_steps=2, topk=4,
                                  num_draft_tokens=16)}.items():
        llm = LLM(str(d), device="cuda", dtype="float32", max_num_seqs=16, **kw)
        llm.engine.grammars = GrammarCache.from_vocab(pieces, stop_token_ids=[1])
        runs[name] = [o.token_ids for o in llm.generate(prompts, params)]
    assert runs["chain"] == runs["off"] and runs["tree"] == runs["off"]
    assert all(t % 3 for i, o in enumerate(runs["off"]) if i % 2 for t in o)


def test_cuda_post_graph_extras_equal_eager(models, monkeypatch):
    """The post graphs with an extra (the logprobs of every row; a grammar's bitmask from the
    fixed device buffer) replay what the eager post-forward does: batches where every row is
    greedy and wants at most that one extra, chains and trees, speculation off too."""
    pytest.importorskip("xgrammar")
    from adaspec.structured import StructuredOutput
    from adaspec.structured.grammar import GrammarCache

    d, h = models["llama"]
    pieces = [chr(0x4E00 + i) for i in range(320)]
    spec = StructuredOutput("regex", "[" + "".join(pieces[i] for i in range(320) if i % 3) + "]*")
    prompts = [[(3 * i + j) % 300 + 3 for j in range(4 + 3 * i)] for i in range(6)]
    g = dict(temperature=0.0, ignore_eos=True, max_tokens=24)
    batches = {"logprobs": [SamplingParams(logprobs=i % 3 * 2 if i % 2 else None, **g) for i in range(6)],
               "grammar": [SamplingParams(structured=spec if i % 2 else None, **g) for i in range(6)]}
    seen = record_post_graphs(monkeypatch)
    for extra, params in batches.items():
        for shape in ({}, dict(speculation="always", num_steps=3), dict(speculation="always", num_steps=2, topk=4,
                                                                          num_draft_tokens=16)):
            outs = {}
            for eager in (True, False):
                llm = LLM(str(d), device="cuda", dtype="float32", max_num_seqs=16, enforce_eager=eager,
                          **(dict(draft=str(h)) if shape else {}), **shape)
                llm.engine.grammars = GrammarCache.from_vocab(pieces, stop_token_ids=[1])
                seen.clear()
                outs[eager] = llm.generate(prompts, params)
                extras = {e for _, e in seen}
                assert (extra in extras) == (not eager), (extra, shape, eager, extras)
            assert [o.token_ids for o in outs[False]] == [o.token_ids for o in outs[True]], (extra, shape)
            for o, r in zip(outs[False], outs[True]):
                assert (o.logprobs is None) == (r.logprobs is None)
                for (lp, top), (rlp, rtop) in zip(o.logprobs or [], r.logprobs or []):
                    assert abs(lp - rlp) < 1e-3 and len(top) == len(rtop)
                    assert [v for _, v in top] == pytest.approx([v for _, v in rtop], abs=1e-3)
            if extra == "grammar":
                assert all(t % 3 for i, o in enumerate(outs[False]) if i % 2 for t in o.token_ids)


def test_cuda_logprobs_penalties_lossless_and_graphs_kept(models):
    """Issue 24 on the device: greedy output and logprobs with penalties, logit_bias and
    min_tokens under chain and tree speculation (CUDA graphs, overlap) equal speculation off;
    plain requests next to them are unchanged."""
    d, h = models["llama"]
    prompts = [[(5 * i + j) % 300 + 3 for j in range(6 + 2 * i)] for i in range(6)]
    g = dict(temperature=0.0, ignore_eos=True, max_tokens=24)
    params = [SamplingParams(logprobs=5, **g), SamplingParams(repetition_penalty=1.3, **g),
              SamplingParams(frequency_penalty=0.5, presence_penalty=0.5, logprobs=0, **g),
              SamplingParams(logit_bias={11: 3.0}, **g), SamplingParams(min_tokens=8, **g), SamplingParams(**g)]
    ref = LLM(str(d), device="cuda", dtype="float32", max_num_seqs=16).generate(prompts, params)
    plain = LLM(str(d), device="cuda", dtype="float32", max_num_seqs=16).generate(prompts, SamplingParams(**g))
    assert ref[5].token_ids == plain[5].token_ids and ref[1].token_ids != plain[1].token_ids
    for shape in (dict(num_steps=3, topk=1), dict(num_steps=2, topk=4, num_draft_tokens=16)):
        llm = LLM(str(d), draft=str(h), speculation="always", device="cuda", dtype="float32", max_num_seqs=16,
                  **shape)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        for o, r in zip(outs, ref):
            for (lp, top), (rlp, rtop) in zip(o.logprobs or [], r.logprobs or []):
                assert abs(lp - rlp) < 1e-3   # alternatives by value: near-ties may swap ids across kernels
                assert [v for _, v in top] == pytest.approx([v for _, v in rtop], abs=1e-3)
