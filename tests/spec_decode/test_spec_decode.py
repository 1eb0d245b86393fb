"""EAGLE-3 speculative decoding: losslessness (greedy and sampled), tree and chain drafts,
KV rollback, checkpoint loading."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.spec_decode.tree import DraftTree
from reference import verify_greedy, verify_sampled
from adaspec.testing import make_eagle3_head, make_tiny_model
from helpers import assert_matches_reference, hf_greedy
from helpers import GREEDY, MAX_NEW, chi2_pvalue, prompts_of_lengths, two_token_law

SHAPES = {
    "chain3": dict(num_steps=3, topk=1),
    "seed-tree": dict(num_steps=2, topk=4, num_draft_tokens=16),
    "tree-s3k2n6": dict(num_steps=3, topk=2, num_draft_tokens=6),
}


@pytest.fixture(scope="module")
def random_head(llama_dir, tmp_path_factory):
    """A random head with a reduced draft vocabulary (exercises d2t): mostly rejected."""
    return str(make_eagle3_head(tmp_path_factory.mktemp("head") / "h", llama_dir, draft_vocab_size=160))


def check_lossless(model_dir, prompts, outs, what):
    compared = 0
    for p, o in zip(prompts, outs):
        ref, logits = hf_greedy(model_dir, p, MAX_NEW)
        compared += assert_matches_reference(o.token_ids, ref, logits, what)
    assert compared > len(prompts) * MAX_NEW // 2


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_lossless_random_head(llama_dir, random_head, shape):
    prompts = prompts_of_lengths([7, 2, 33, 18], seed=11)
    llm = LLM(llama_dir, draft=random_head, speculation="always", device="cpu", dtype="float32",
              block_size=4, max_num_batched_tokens=16, **SHAPES[shape])
    outs = llm.generate(prompts, GREEDY)
    check_lossless(llama_dir, prompts, outs, shape)
    st = llm.stats()
    assert st["verify_steps"] > 0 and st["draft_tokens"] > 0
    assert st["num_free_blocks"] == st["num_total_blocks"]


@pytest.mark.parametrize("shape,num_blocks", [("chain3", 36), ("seed-tree", 20)])
def test_greedy_lossless_with_trained_head(agree_dir, trained_head, shape, num_blocks):
    """Partly-agreeing draft: accepted and rejected paths, prefix hits, chunking, preemption."""
    shared = prompts_of_lengths([13], seed=12)[0]
    prompts = [shared + t for t in prompts_of_lengths([3, 9, 1, 6], seed=13)] + prompts_of_lengths([5, 21], seed=14)
    llm = LLM(agree_dir, draft=trained_head, speculation="always", device="cpu", dtype="float32",
              block_size=4, max_num_batched_tokens=32, num_kv_blocks=num_blocks, **SHAPES[shape])
    outs = llm.generate(prompts, GREEDY)
    check_lossless(agree_dir, prompts, outs, shape)
    st = llm.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0
    assert st["accepted_tokens"] > 0 and st["accepted_tokens"] < st["draft_tokens"]
    assert st["num_free_blocks"] == st["num_total_blocks"]
    # Per-request figures add up to the global ones.
    assert sum(o.spec["verify_steps"] for o in outs) == st["verify_steps"]
    assert sum(o.spec["accepted_tokens"] for o in outs) == st["accepted_tokens"]


def test_acceptance_of_trained_head(agree_dir, trained_head):
    prompts = prompts_of_lengths([6, 11, 17, 4], seed=15)
    llm = LLM(agree_dir, draft=trained_head, speculation="always", num_steps=3, topk=1,
              device="cpu", dtype="float32")
    llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    st = llm.stats()
    assert 1.3 < st["accept_length"] < 4.0, st
    rates = st["accept_rate_per_position"]
    assert len(rates) == 3 and rates[0] >= rates[1] >= rates[2]


def test_stops_inside_an_accepted_run(agree_dir, trained_head):
    """stop ids / max_tokens that fall inside an accepted run cut the output at the right token."""
    prompts = prompts_of_lengths([6, 11, 17, 4], seed=15)
    plain = LLM(agree_dir, device="cpu", dtype="float32")
    spec = LLM(agree_dir, draft=trained_head, speculation="always", num_steps=3, device="cpu", dtype="float32")
    full = plain.generate(prompts, GREEDY)
    for o, p in zip(full, prompts):
        stop = o.token_ids[len(o.token_ids) // 2]
        for sp in (SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop]),
                   SamplingParams(max_tokens=len(o.token_ids) // 2 + 1, temperature=0.0, ignore_eos=True)):
            a = plain.generate([p], sp)[0]
            b = spec.generate([p], sp)[0]
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    assert spec.stats()["accepted_tokens"] > 0
    assert spec.stats()["num_free_blocks"] == spec.stats()["num_total_blocks"]


def test_speculation_off_with_draft_equals_no_draft(llama_dir, random_head):
    prompts = prompts_of_lengths([9, 3, 14], seed=16)
    a = LLM(llama_dir, device="cpu", dtype="float32").generate(prompts, GREEDY)
    llm = LLM(llama_dir, draft=random_head, speculation="off", device="cpu", dtype="float32")
    b = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert llm.engine.runner.draft is None and llm.stats()["verify_steps"] == 0


# ---- sampling is lossless -------------------------------------------------------------------

def test_verify_sampled_follows_target_distribution():
    """Pure function: root with three children; the emitted first token ~ p[root] and the
    second (after an accepted child) ~ p[child]. False-alarm rate: 2 tests at p < 1e-3."""
    torch.manual_seed(0)
    V = 6
    probs = torch.softmax(torch.randn(4, V) * 1.5, dim=-1)
    tree = DraftTree(tokens=[0, 2, 4, 1], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2])
    g = torch.Generator().manual_seed(1)
    n = 20000
    first, second = {}, {}
    for _ in range(n):
        path, bonus = verify_sampled(tree, probs, g)
        toks = [tree.tokens[j] for j in path] + [bonus]
        first[toks[0]] = first.get(toks[0], 0) + 1
        if path and path[0] == 1:
            second[toks[1]] = second.get(toks[1], 0) + 1
    assert chi2_pvalue(first, dict(enumerate(probs[0].tolist())), n) > 1e-3
    m = sum(second.values())
    assert m > 1000
    assert chi2_pvalue(second, dict(enumerate(probs[1].tolist())), m) > 1e-3
    # Greedy verification on one-hot rows accepts exactly the argmax path.
    assert verify_greedy(tree, [2, 1, 0, 0]) == ([1, 3], 0)
    assert verify_greedy(tree, [5, 1, 0, 0]) == ([], 5)


def test_sampled_speculation_matches_target_distribution(tmp_path):
    """End to end on a vocabulary of 8: the joint law of the first two generated tokens
    (the second one produced by a verify step) equals the target's p(t1) p(t2 | t1).
    False-alarm rate 1e-3."""
    d = make_tiny_model(tmp_path / "v8", "llama", vocab_size=8, init_std=0.1, eos_token_id=None)
    head = make_eagle3_head(tmp_path / "h8", d)
    n = 3000
    pvalue, llm = two_token_law(d, head, n)
    st = llm.stats()
    assert st["verify_steps"] >= n and 0 < st["accepted_tokens"] < st["draft_tokens"]
    assert pvalue > 1e-3
    prompt, temp = [1, 5, 3, 2, 7], 1.3
    # Seeded requests are reproducible under speculation.
    sp = SamplingParams(max_tokens=12, temperature=temp, seed=5, ignore_eos=True)
    assert llm.generate([prompt], sp)[0].token_ids == llm.generate([prompt], sp)[0].token_ids


# ---- loading --------------------------------------------------------------------------------

def test_specforge_layout_variants_load(llama_dir, tmp_path):
    """`layers.0.` naming, an own embed_tokens and aux layer ids from the config all load."""
    from safetensors.torch import load_file, save_file

    h = make_eagle3_head(tmp_path / "h", llama_dir, aux_layer_ids=[0, 1, 2], with_embed=True)
    sd = load_file(str(h / "model.safetensors"))
    sd = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    save_file(sd, str(h / "model.safetensors"))
    cfg = json.loads((h / "config.json").read_text())
    cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
    (h / "config.json").write_text(json.dumps(cfg))
    llm = LLM(llama_dir, draft=str(h), speculation="always", device="cpu", dtype="float32")
    assert llm.engine.runner.draft.aux_layers == (1, 2, 3)
    assert llm.engine.runner.draft.embed_tokens is not None
    out = llm.generate(prompts_of_lengths([5], seed=17), GREEDY)[0]
    ref, logits = hf_greedy(llama_dir, prompts_of_lengths([5], seed=17)[0], MAX_NEW)
    assert_matches_reference(out.token_ids, ref, logits, "layers.0 head")


def test_mismatched_head_is_a_load_error(llama_dir, tmp_path):
    other = make_tiny_model(tmp_path / "wide", "llama", hidden_size=96, num_heads=4, vocab_size=320)
    h = make_eagle3_head(tmp_path / "h", other)
    with pytest.raises(ValueError, match="hidden|shape"):
        LLM(llama_dir, draft=str(h), speculation="always", device="cpu")
    h2 = make_eagle3_head(tmp_path / "h2", llama_dir)
    cfg = json.loads((h2 / "config.json").read_text())
    cfg["vocab_size"] = 999
    (h2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(llama_dir, draft=str(h2), speculation="always", device="cpu")
    shutil.rmtree(h2)
    # A head is recognised by its tensors, not its architecture name: a plain Llama
    # (LlamaForCausalLM, no fc) passed as the draft is refused.
    with pytest.raises(ValueError, match="not an EAGLE-3 head.*fc.weight"):
        LLM(llama_dir, draft=llama_dir, speculation="always", device="cpu")


def test_sliding_window_with_chunks_and_trees(tmp_path):
    """Mistral with an 8-token window (much shorter than the sequence): chunked prefill and
    tree verification both respect it, so the output equals transformers'."""
    d = make_tiny_model(tmp_path / "m", "mistral")
    cfg = json.loads((d / "config.json").read_text())
    cfg["sliding_window"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    h = make_eagle3_head(tmp_path / "h", d)
    prompts = prompts_of_lengths([20, 13], seed=18)
    plain = LLM(str(d), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8).generate(prompts, GREEDY)
    tree = LLM(str(d), draft=str(h), speculation="always", num_steps=2, topk=3, num_draft_tokens=6,
               device="cpu", dtype="float32", block_size=4).generate(prompts, GREEDY)
    check_lossless(str(d), prompts, plain, "window chunked")
    check_lossless(str(d), prompts, tree, "window tree")


def test_seeded_output_independent_of_speculation_depth_and_batch(tmp_path):
    """Issue 23 item 4: a seeded request's tokens are a function of its seed alone: alone with
    speculation off, chains of 1 and 4, a tree, a per-request cap, and inside a batch of 32
    (with other seeded and unseeded requests), all identical; a different seed differs.
    (A vocabulary of 8, so that sampled drafts are often accepted.)"""
    d = make_tiny_model(tmp_path / "v8", "llama", vocab_size=8, init_std=0.1, eos_token_id=None)
    head = make_eagle3_head(tmp_path / "h8", d)
    prompt = [1, 5, 3, 2, 7, 6, 4]
    sp = dict(max_tokens=32, temperature=0.9, top_p=0.95, ignore_eos=True)
    seeded = SamplingParams(seed=1234, **sp)
    configs = {"off": {}, "chain1": dict(num_steps=1, topk=1), "chain4": dict(num_steps=4, topk=1),
               "tree": dict(num_steps=3, topk=2, num_draft_tokens=6)}
    outs = {}
    for name, kw in configs.items():
        draft = dict(draft=str(head), speculation="always", **kw) if kw else {}
        llm = LLM(str(d), device="cpu", dtype="float32", seed=5 + len(outs), **draft)
        outs[name] = llm.generate([prompt], seeded)[0].token_ids
        if kw:
            assert llm.stats()["accepted_tokens"] > 0, name      # verification really ran
        if name == "chain4":
            capped = SamplingParams(seed=1234, max_draft_tokens=2, **sp)
            outs["chain4-cap2"] = llm.generate([prompt], capped)[0].token_ids
            rng = torch.Generator().manual_seed(3)
            others = [torch.randint(0, 8, (3 + i % 7,), generator=rng).tolist() for i in range(31)]
            batch = [SamplingParams(seed=i if i % 2 else None, **sp) for i in range(31)]
            res = llm.generate(others[:16] + [prompt] + others[16:], batch[:16] + [seeded] + batch[16:])
            outs["chain4-batch32"] = res[16].token_ids
            outs["chain4-seed99"] = llm.generate([prompt], SamplingParams(seed=99, **sp))[0].token_ids
    other = outs.pop("chain4-seed99")
    assert len({tuple(v) for v in outs.values()}) == 1, outs
    assert other != outs["off"]
