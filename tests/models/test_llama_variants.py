"""Llama-family variants that published checkpoints use, each equal to transformers' greedy
output: biases on every Llama projection (`attention_bias` covers o_proj too, `mlp_bias` the
MLP), Qwen3 with YaRN rope, Phi-3 / Phi-4 (fused qkv_proj and gate_up_proj in the checkpoint,
partial rotary, longrope across its original context); speculation on them stays lossless. A checkpoint bias the config
leaves no place for is a load error, not a silently different model."""
from __future__ import annotations

import json

import pytest

from adaspec import LLM, SamplingParams
from adaspec.models.registry import parse_model_spec
from adaspec.testing import make_eagle3_head, make_tiny_model
from helpers import GREEDY, MAX_NEW, assert_matches_reference, check_against_hf, hf_greedy, prompts_of_lengths

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama_bias", "qwen3_yarn", "phi3", "phi3_partial", "phi3_longrope"])
def test_variant_equals_transformers_and_speculation_is_lossless(arch, tmp_path):
    d = make_tiny_model(tmp_path / arch, arch, max_position=256)
    # The second runs past YaRN's original 32 positions; longrope's stay within theirs (past it,
    # transformers' generate recomputes the sequence: the next test compares there).
    prompts = prompts_of_lengths([9, 8 if arch == "phi3_longrope" else 40], seed=7)
    plain = LLM(str(d), device="cpu", dtype="float32").generate(prompts, GREEDY)
    for p, o in zip(prompts, plain):
        ref, logits = hf_greedy(str(d), p, MAX_NEW)
        assert assert_matches_reference(o.token_ids, ref, logits, arch) >= MAX_NEW // 2
    head = make_eagle3_head(tmp_path / "head", d)
    spec = LLM(str(d), draft=str(head), speculation="always", num_steps=3, device="cpu", dtype="float32")
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == [o.token_ids for o in plain]


def test_a_bias_the_config_does_not_declare_is_a_load_error(tmp_path):
    d = make_tiny_model(tmp_path / "m", "llama_bias")
    cfg = json.loads((d / "config.json").read_text())
    cfg["mlp_bias"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"bias tensor\(s\).*mlp\..*_proj\.bias"):
        LLM(str(d), device="cpu", dtype="float32")


def test_biased_checkpoints_refuse_tensor_parallelism(tmp_path):
    from adaspec.models.registry import parse_model_spec
    from adaspec.parallel.shard import Shard

    spec, _ = parse_model_spec(make_tiny_model(tmp_path / "m", "llama_bias"))
    assert spec.o_bias and spec.mlp_bias
    with pytest.raises(ValueError, match="one GPU only"):
        Shard(0, 2).local_spec(spec)


def test_unread_checkpoint_tensors_are_named_in_a_warning(tmp_path, caplog):
    import torch
    from safetensors.torch import load_file, save_file

    d = make_tiny_model(tmp_path / "m", "llama")
    f = d / "model.safetensors"
    sd = load_file(str(f))
    sd["model.mtp_layers.0.weight"] = torch.zeros(4)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)   # harmless: not named
    save_file(sd, str(f), metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="adaspec"):
        LLM(str(d), device="cpu", dtype="float32")
    said = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(said) == 1 and "1 tensor(s)" in said[0] and "model.mtp_layers.0.weight" in said[0]


def test_longrope_past_the_original_context_equals_transformers_cached_forward(tmp_path):
    """Past the original context longrope takes its long factors from that position on, as
    transformers' model does with its KV cache, one token per forward (its `generate` instead
    recomputes the whole sequence there: rotary.py `_longrope`)."""
    import inspect

    import torch
    from transformers import AutoModelForCausalLM

    d = make_tiny_model(tmp_path / "lr", "phi3_longrope", max_position=256)
    prompt = prompts_of_lengths([20], seed=7)[0]            # 20 + 24 tokens cross position 32
    got = LLM(str(d), device="cpu", dtype="float32").generate([prompt], GREEDY)[0].token_ids
    m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    key = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"   # (renamed in 5.x)
    want = []
    with torch.no_grad():
        out = m(torch.tensor([prompt]), use_cache=True)
        for _ in range(MAX_NEW):
            want.append(int(out.logits[0, -1].argmax()))
            cache = out.get("cache") if out.get("cache") is not None else out.past_key_values
            out = m(torch.tensor([[want[-1]]]), use_cache=True, **{key: cache})
    assert got == want
    short = LLM(str(d), device="cpu", dtype="float32", max_model_len=64)   # (the same cache, cut shorter)
    assert short.generate([prompt], GREEDY)[0].token_ids == want


@pytest.mark.parametrize("arch,max_window_layers", [("qwen2", 1), ("qwen2", 3), ("qwen3", 2)])
def test_qwen_window_layers_without_layer_types(tmp_path, arch, max_window_layers):
    """An older Qwen config (use_sliding_window on, no `layer_types`): the window applies from
    layer max_window_layers on, as transformers derives it; the output equals transformers'."""
    d = make_tiny_model(tmp_path / "m", arch)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=6, max_window_layers=max_window_layers)
    cfg.pop("layer_types", None)
    (d / "config.json").write_text(json.dumps(cfg))
    spec, _ = parse_model_spec(d)
    assert spec.sliding_windows == tuple(6 if i >= max_window_layers else None for i in range(spec.num_layers))
    prompts = prompts_of_lengths([20, 11], seed=5)
    outs = LLM(str(d), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8).generate(prompts, GREEDY)
    check_against_hf(str(d), prompts, outs, f"{arch} window from layer {max_window_layers}")
