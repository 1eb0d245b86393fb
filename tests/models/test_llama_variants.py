"""Llama-family variants that published checkpoints use, each equal to transformers' greedy
output: biases on every Llama projection (`attention_bias` covers o_proj too, `mlp_bias` the
MLP), Qwen3 with YaRN rope, Phi-3 / Phi-4 (fused qkv_proj and gate_up_proj in the checkpoint,
a partial rotary variant); speculation on them stays lossless. A checkpoint bias the config
leaves no place for is a load error, not a silently different model."""
from __future__ import annotations

import json

import pytest

from adaspec import LLM, SamplingParams
from adaspec.testing import make_eagle3_head, make_tiny_model
from helpers import MAX_NEW, assert_matches_reference, hf_greedy, prompts_of_lengths

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama_bias", "qwen3_yarn", "phi3", "phi3_partial"])
def test_variant_equals_transformers_and_speculation_is_lossless(arch, tmp_path):
    d = make_tiny_model(tmp_path / arch, arch, max_position=256)
    prompts = prompts_of_lengths([9, 40], seed=7)   # the second runs past YaRN's original 32 positions
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
