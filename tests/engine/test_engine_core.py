"""Engine core: exact greedy match with transformers, chunked prefill, preemption, prefix
caching, KV accounting, sampling and input validation."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.testing import make_tiny_model
from helpers import ARCHS, GREEDY, MAX_NEW, check_against_hf, prompts_of_lengths






@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(model_dirs, arch):
    """Mixed prompt lengths, chunked prefill forced by a 16-token step budget."""
    d = model_dirs[arch]
    prompts = prompts_of_lengths([7, 2, 40, 19])
    llm = LLM(d, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(prompts, GREEDY)
    check_against_hf(d, prompts, outs, f"{arch} chunked")
    st = llm.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]
    assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_NEW for o in outs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_preemption_by_recompute(model_dirs, arch):
    d = model_dirs[arch]
    prompts = prompts_of_lengths([12, 20, 9, 17, 15], seed=1)
    # 24 blocks of 4 = 96 tokens; the batch needs ~200 at its peak: preemption must happen.
    llm = LLM(d, device="cpu", dtype="float32", block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    st = llm.stats()
    assert st["num_preemptions"] > 0
    check_against_hf(d, prompts, outs, f"{arch} preempted")
    assert st["num_free_blocks"] == st["num_total_blocks"] == 24


def test_prefix_cache_hits(llama_dir):
    shared = prompts_of_lengths([21], seed=2)[0]
    prompts = [shared + tail for tail in prompts_of_lengths([3, 6, 1], seed=3)] + [shared[:9]]
    llm = LLM(llama_dir, device="cpu", dtype="float32", block_size=4)
    first = llm.generate(prompts[:1], GREEDY)
    hits_before = llm.stats()["prefix_cache_hit_tokens"]
    outs = llm.generate(prompts, GREEDY)
    assert llm.stats()["prefix_cache_hit_tokens"] - hits_before >= 3 * 20
    assert outs[0].num_cached_tokens >= 20 and outs[0].token_ids == first[0].token_ids
    check_against_hf(llama_dir, prompts, outs, "prefix cache")
    st = llm.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_prefix_cache_with_preemption_and_chunking(llama_dir):
    shared = prompts_of_lengths([18], seed=4)[0]
    prompts = [shared + t for t in prompts_of_lengths([2, 5, 8, 11], seed=5)]
    llm = LLM(llama_dir, device="cpu", dtype="float32", block_size=4, num_kv_blocks=30, max_num_batched_tokens=12)
    outs = llm.generate(prompts, GREEDY)
    check_against_hf(llama_dir, prompts, outs, "prefix+preempt+chunk")
    st = llm.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_sharded_tied_and_half_precision(tmp_path):
    d = make_tiny_model(tmp_path / "sharded", "llama", tie_word_embeddings=True, shard_bytes=60_000)
    assert (d / "model.safetensors.index.json").exists()
    prompts = prompts_of_lengths([5, 11], seed=6)
    outs = LLM(str(d), device="cpu", dtype="float32").generate(prompts, GREEDY)
    check_against_hf(str(d), prompts, outs, "sharded tied")
    for dtype in ("bfloat16", "float16"):
        o = LLM(str(d), device="cpu", dtype=dtype).generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
        assert all(len(x.token_ids) == 4 for x in o)


def test_dummy_weights_need_no_safetensors(tmp_path, llama_dir):
    d = tmp_path / "shape-only"
    d.mkdir()
    shutil.copy(f"{llama_dir}/config.json", d / "config.json")
    outs = LLM(str(d), device="cpu", load_format="dummy").generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert len(outs[0].token_ids) == 3
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(d), device="cpu")


def test_load_format_safetensors_and_pt_read_only_those_files(tmp_path, llama_dir):
    """vLLM's --load-format values: a directory holding both kinds (the .bin here perturbed,
    so which one was read shows in the output)."""
    from safetensors.torch import load_file

    d = tmp_path / "both"
    shutil.copytree(llama_dir, d)
    sd = load_file(str(d / "model.safetensors"))
    torch.save({k: v + 0.5 if k.endswith("mlp.down_proj.weight") else v for k, v in sd.items()}, d / "pytorch_model.bin")
    out = {f: LLM(str(d), device="cpu", dtype="float32", load_format=f).generate([[1, 2, 3]], GREEDY)[0].token_ids
           for f in ("auto", "safetensors", "pt")}
    assert out["auto"] == out["safetensors"] != out["pt"]
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"expected \*\.safetensors \(load_format 'safetensors'"):
        LLM(str(d), device="cpu", load_format="safetensors")
    assert LLM(str(d), device="cpu", dtype="float32").generate([[1, 2, 3]], GREEDY)[0].token_ids == out["pt"]


def test_unknown_architecture_and_missing_tensor(tmp_path, llama_dir):
    d = tmp_path / "weird"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(d), device="cpu")
    from safetensors.torch import load_file, save_file
    d2 = tmp_path / "missing"
    shutil.copytree(llama_dir, d2)
    sd = load_file(str(d2 / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(d2 / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LLM(str(d2), device="cpu")


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llama_dir):
    llm = LLM(llama_dir, device="cpu", dtype="float32")
    prompts = prompts_of_lengths([6, 13, 4], seed=7)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a = llm.generate(prompts, sp)
    # Same seed, different batch companions: same tokens.
    b = llm.generate(prompts[::-1] + prompts_of_lengths([9], seed=8), sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b[:3][::-1]]
    c = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    g = llm.generate(prompts, GREEDY)
    k1 = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_k=1, ignore_eos=True))
    assert [o.token_ids for o in g] == [o.token_ids for o in k1]


def test_sampler_follows_the_distribution():
    from adaspec.sampling import SamplingBatch, choose, process_logits
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    p = SamplingParams(temperature=0.7, top_k=4, top_p=0.95, min_p=0.05)
    probs = process_logits(logits, [p])[0]
    assert probs[3] == 0.0  # removed by top-k
    n = 20000
    # The counter-based draws: one per (seed, position); many of both.
    seeds = torch.arange(n) // 100 * 7919 + 3
    batch = SamplingBatch.of([p] * n, seeds.tolist(), torch.device("cpu"))
    draws = choose(logits.expand(n, -1), batch, torch.arange(n) % 100)
    freq = torch.bincount(draws, minlength=5).float() / n
    # 5 sigma of a binomial at n=20000 is < 0.018
    assert torch.allclose(freq, probs, atol=0.018), (freq, probs)
    # The same (seed, position) draws the same token; greedy rows take the argmax.
    again = choose(logits.expand(n, -1), batch, torch.arange(n) % 100)
    assert torch.equal(draws, again)
    g = SamplingBatch.of([SamplingParams(temperature=0.0)] * 3, [1, 2, 3], torch.device("cpu"))
    assert choose(logits.expand(3, -1), g, torch.arange(3)).tolist() == [0, 0, 0]


def test_stop_token_ids_eos_and_max_tokens(llama_dir):
    llm = LLM(llama_dir, device="cpu", dtype="float32")
    prompt = prompts_of_lengths([8], seed=9)
    full = llm.generate(prompt, GREEDY)[0].token_ids
    stop_tok = full[5]
    first = full.index(stop_tok)
    out = llm.generate(prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == full[:first + 1] and out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == full[:3] and out.finish_reason == "length"


def test_eos_stops_unless_ignored(tmp_path, llama_dir):
    llm0 = LLM(llama_dir, device="cpu", dtype="float32")
    prompt = prompts_of_lengths([8], seed=10)
    full = llm0.generate(prompt, GREEDY)[0].token_ids
    d = tmp_path / "eos"
    shutil.copytree(llama_dir, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [full[4], 999999]
    (d / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(d), device="cpu", dtype="float32")
    out = llm.generate(prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))[0]
    assert out.token_ids == full[:full.index(full[4]) + 1] and out.finish_reason == "stop"
    assert llm.generate(prompt, GREEDY)[0].token_ids == full


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "empty"),
    ([1, 2, 100000], SamplingParams(), "out of range"),
    ([-1, 2], SamplingParams(), "out of range"),
    (list(range(3, 300)) * 2, SamplingParams(max_tokens=10), "context"),
    ([1, 2, 3], SamplingParams(max_tokens=510), "context"),
    ("text without tokenizer", SamplingParams(), "tokenizer"),
])
def test_bad_input_raises(llama_dir, prompt, params, match):
    llm = _shared_llm(llama_dir)
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params)
    st = llm.stats()
    assert st["num_running"] == st["num_waiting"] == 0  # nothing half-added


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature="0.5"), "temperature"),
    (dict(stop=5), "stop must be a string or a list of strings"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


_llms: dict = {}


def _shared_llm(d):
    if d not in _llms:
        _llms[d] = LLM(d, device="cpu", dtype="float32")
    return _llms[d]


def test_text_prompts_incremental_detokenization_and_stop_strings(tok_model_dir):
    llm = LLM(tok_model_dir, device="cpu", dtype="float32")
    tok = llm.tokenizer
    outs = llm.generate(["Hello world! café 日本語", "def add(a, b):"],
                        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for o in outs:
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    # Streaming deltas (engine.step) concatenate to the final text, multi-byte chars included.
    eng = llm.engine
    rid = eng.add_request("s", "café 日本語 😀", SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True))
    pieces, final = [], None
    while eng.has_unfinished():
        for o in eng.step():
            pieces.append(o.new_text)
            if o.finished:
                final = o
    assert "".join(pieces) == final.text == tok.decode(final.token_ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces[:-1]) or "\ufffd" in final.text
    # Stop string: cut before it, finish_reason stop.
    text = outs[0].text
    stop = text[10:13]
    o = llm.generate(["Hello world! café 日本語"], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop],
                                                                 ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.text == text[:text.index(stop)]
    assert rid == "s"


def test_stop_token_ids_outside_the_vocabulary_are_refused(llama_dir):
    llm = LLM(llama_dir, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop_token_ids=[llm.engine.vocab_size + 3]))


def test_step_outputs_are_snapshots_unless_delta_outputs(llama_dir):
    """`Engine.step` outputs keep what they said (token_ids copied); with `delta_outputs` (the
    server's engine process, which reads only new_token_ids) token_ids is the request's own
    list, with no copy per step."""
    from adaspec.engine.engine import Engine

    for delta in (False, True):
        eng = LLM(llama_dir, device="cpu", dtype="float32").engine
        eng.delta_outputs = delta
        eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        seen = []
        while eng.has_unfinished():
            seen += [(o, list(o.token_ids), list(o.new_token_ids)) for o in eng.step()]
        assert isinstance(eng, Engine) and seen[-1][0].finished
        assert sum((new for _, _, new in seen), []) == seen[-1][1]
        if delta:
            assert all(o.token_ids == seen[-1][1] for o, _, _ in seen)      # one list, grown
        else:
            assert all(o.token_ids == ids for o, ids, _ in seen)          # each kept its own
            assert len(seen) > 1 and len(seen[0][1]) < len(seen[-1][1])


def test_max_model_len_beyond_the_trained_positions_is_warned(llama_dir, caplog):
    """vLLM refuses it; rope scaling can make it sensible, so adaspec serves it and says so."""
    with caplog.at_level("WARNING", logger="adaspec"):
        llm = LLM(llama_dir, device="cpu", dtype="float32", max_model_len=600, num_gpu_blocks_override=64)
    assert llm.engine.max_model_len == 600 and "max_position_embeddings=512" in caplog.text
