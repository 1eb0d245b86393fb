"""Mixture-of-experts targets (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5): greedy output equal to
transformers, checkpoint loading (per-expert layouts stacked into [E, ...], shards, refusals),
and speculative decoding with a MoE target."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adaspec import LLM
from adaspec.models.loader import load_model
from adaspec.models.moe import MoeForCausalLM, SparseMoeBlock
from adaspec.models.registry import parse_model_spec
from adaspec.testing import make_eagle3_head
from moe_models import MOE_CONFIGS, make_moe_model
from helpers import GREEDY, check_against_hf, prompts_of_lengths


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny MoE layers are dozens of small ops: on a loaded 2-core box torch's intra-op threads
    spin against each other (one run took 40x longer); one thread is also the fastest."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: str(make_moe_model(root / name, name)) for name in MOE_CONFIGS}


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_greedy_matches_transformers(moe_dirs, name):
    """Mixed prompt lengths with chunked prefill (16-token step budget): every MoE layer sees
    batches of several requests, prefill and decode rows together."""
    d = moe_dirs[name]
    prompts = prompts_of_lengths([7, 2, 29, 13])
    llm = LLM(d, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16)
    check_against_hf(d, prompts, llm.generate(prompts, GREEDY), name)


@pytest.mark.parametrize("name,windowed", [("qwen2_moe", (6, None, 6)), ("qwen3_moe_raw", (6, 6, 6))])
def test_window_layers_of_an_older_config(tmp_path, name, windowed):
    """use_sliding_window on and no `layer_types` (an older config): transformers' rule per
    architecture (Qwen2-MoE: even layers below max_window_layers; Qwen3-MoE: every layer)."""
    d = make_moe_model(tmp_path / name, name)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=6, max_window_layers=3)
    cfg.pop("layer_types", None)
    (d / "config.json").write_text(json.dumps(cfg))
    assert parse_model_spec(d)[0].sliding_windows == windowed
    prompts = prompts_of_lengths([21, 12])
    llm = LLM(str(d), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    check_against_hf(str(d), prompts, llm.generate(prompts, GREEDY), f"{name} windows")


def test_specs_read_from_config(moe_dirs):
    """What each config turns into: sparse layers, router kind, shared experts, rotary width."""
    s, _ = parse_model_spec(moe_dirs["qwen3_moe"])
    assert s.moe.sparse_layers == (True, False, True, True) and s.qk_norm  # mlp_only_layers=[1]
    assert s.moe.router.kind == "softmax" and s.moe.router.renormalize and s.moe.shared_intermediate_size == 0
    s, _ = parse_model_spec(moe_dirs["qwen3_moe_raw"])
    assert s.moe.sparse_layers == (False, True, False) and not s.moe.router.renormalize  # decoder_sparse_step=2
    s, _ = parse_model_spec(moe_dirs["qwen2_moe"])
    assert s.moe.shared_gate and s.moe.shared_intermediate_size == 48 and s.qkv_bias
    s, _ = parse_model_spec(moe_dirs["mixtral"])
    assert s.moe.router.top_k == 2 and s.moe.router.renormalize and s.moe.layout == "mixtral"
    s, klass = parse_model_spec(moe_dirs["glm4_moe"])
    assert klass is MoeForCausalLM and s.moe.sparse_layers == (False, True, True, True)
    r = s.moe.router
    assert (r.kind, r.n_group, r.topk_group, r.scaling) == ("sigmoid_group", 4, 2, 2.5)
    assert s.qk_norm and s.qkv_bias and s.moe.router_bias and s.moe.shared_intermediate_size == 32
    model = MoeForCausalLM(s)
    assert model.rotary.rot_dim == 16 and s.head_dim == 32  # partial_rotary_factor 0.5


def test_partial_rotary_from_a_top_level_key(moe_dirs, tmp_path):
    """GLM-4.5's published config.json has rope_theta and partial_rotary_factor at the top level
    (older transformers); without the key transformers defaults GLM-4 MoE to 0.5."""
    cfg = json.loads(open(moe_dirs["glm4_moe"] + "/config.json").read())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=10000.0, partial_rotary_factor=0.25)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s, _ = parse_model_spec(tmp_path)
    assert s.rope_parameters["partial_rotary_factor"] == 0.25
    cfg.pop("partial_rotary_factor")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert parse_model_spec(tmp_path)[0].rope_parameters["partial_rotary_factor"] == 0.5


EXPERT_NAMES = {  # (block, gate, up, down) as each architecture publishes them
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "glm4_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


@pytest.mark.parametrize("name", sorted(EXPERT_NAMES))
def test_per_expert_tensors_are_stacked(moe_dirs, name):
    """w13[e] = [gate_e; up_e] and w2[e] = down_e, read from the per-expert checkpoint names."""
    d = moe_dirs[name]
    block, gate, up, down = EXPERT_NAMES[name]
    model, spec, _ = load_model(d, torch.device("cpu"), "float32")
    with safe_open(d + "/model.safetensors", "pt") as f:
        ckpt = {k: f.get_tensor(k) for k in f.keys()}
    I = spec.moe.intermediate_size
    checked = 0
    for i, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        for e in range(spec.moe.router.num_experts):
            pre = f"model.layers.{i}.{block}.experts.{e}"
            assert torch.equal(layer.mlp.experts.w13[e, :I], ckpt[f"{pre}.{gate}.weight"])
            assert torch.equal(layer.mlp.experts.w13[e, I:], ckpt[f"{pre}.{up}.weight"])
            assert torch.equal(layer.mlp.experts.w2[e], ckpt[f"{pre}.{down}.weight"])
            checked += 1
        assert torch.equal(layer.mlp.gate.weight, ckpt[f"model.layers.{i}.{block}.gate.weight"])
    assert checked >= 2 * spec.moe.router.num_experts


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"])
def test_checkpoint_of_transformers5_stacked_experts(moe_dirs, tmp_path, name):
    """A checkpoint written from transformers 5's own state dict (each layer's experts stacked
    under `mlp`, Mixtral's router there too) loads to the very weights of the published
    per-expert layout: whole, as a tensor-parallel shard and as an expert-parallel one."""
    from transformers import AutoModelForCausalLM

    from adaspec.parallel import Shard

    d = moe_dirs[name]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    out = tmp_path / name
    out.mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(open(d + "/config.json").read())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert any(k.endswith(".mlp.experts.gate_up_proj") for k in f.keys())
    for shard in (None, Shard(1, 2), Shard(1, 2, expert_parallel=True)):
        want = load_model(d, torch.device("cpu"), "float32", shard=shard)[0].state_dict()
        got = load_model(out, torch.device("cpu"), "float32", shard=shard)[0].state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), (name, shard)


def test_sharded_checkpoint_splits_a_layers_experts(tmp_path):
    """Shards of ~24 kB put one layer's experts in several files; the result equals HF."""
    d = make_moe_model(tmp_path / "m", "glm4_moe", shard_bytes=24_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    files = {f for k, f in index.items() if ".layers.1.mlp.experts." in k}
    assert len(files) > 1, files
    prompts = prompts_of_lengths([9, 4], seed=3)
    check_against_hf(str(d), prompts, LLM(str(d), device="cpu", dtype="float32").generate(prompts, GREEDY), "sharded")


def test_missing_expert_tensor_is_named(tmp_path):
    d = make_moe_model(tmp_path / "m", "mixtral")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.2.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.block_sparse_moe\.experts\.3\.w3\.weight"):
        load_model(d, torch.device("cpu"), "float32")


@pytest.mark.parametrize("name,key,value", [
    ("qwen3_moe", "scoring_func", "sigmoid"),          # a known key at a value adaspec does not implement
    ("glm4_moe", "topk_method", "group_limited_greedy"),
    ("mixtral", "moe_layer_freq", 2),                  # a routing key this architecture does not have
    ("qwen2_moe", "n_group", 2),
    ("glm4_moe", "n_group", 3),                        # does not divide the 16 experts
])
def test_unsupported_routing_option_is_refused_by_name(moe_dirs, tmp_path, name, key, value):
    cfg = json.loads(open(moe_dirs[name] + "/config.json").read())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key):
        parse_model_spec(tmp_path)


def test_published_keys_are_accepted(moe_dirs, tmp_path):
    """Keys real configs carry that inference does not use (aux losses, MTP layers) are fine."""
    cfg = json.loads(open(moe_dirs["glm4_moe"] + "/config.json").read())
    cfg.update(router_aux_loss_coef=0.001, output_router_logits=False, num_nextn_predict_layers=1,
               scoring_func="sigmoid", topk_method="noaux_tc")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert parse_model_spec(tmp_path)[0].moe.router.kind == "sigmoid_group"


# ---- speculative decoding with a MoE target -------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,aux", [("glm4_moe", [1, 2, 3]), ("qwen3_moe", None)])
@pytest.mark.parametrize("shape", [dict(num_steps=3, topk=1), dict(num_steps=2, topk=3, num_draft_tokens=6)])
def test_speculation_is_lossless_with_a_moe_target(moe_dirs, tmp_path, name, aux, shape):
    """EAGLE-3 with aux features from MoE layers (GLM ids [1, 2, 3] = outputs of its sparse
    layers 1..3): greedy with speculation equals transformers, through chunked prefill,
    prefix hits and preemption (24 blocks of 4 tokens)."""
    d = moe_dirs[name]
    head = make_eagle3_head(tmp_path / "h", d, aux_layer_ids=aux)
    shared = prompts_of_lengths([10], seed=21)[0]
    prompts = [shared + t for t in prompts_of_lengths([3, 7], seed=22)] + prompts_of_lengths([17, 5], seed=23)
    llm = LLM(d, draft=str(head), speculation="always", device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=16, num_kv_blocks=24, **shape)
    check_against_hf(d, prompts, llm.generate(prompts, GREEDY), f"{name} speculative")
    st = llm.stats()
    assert st["verify_steps"] > 0 and st["draft_tokens"] > 0
    assert st["num_preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0
    assert st["num_free_blocks"] == st["num_total_blocks"]


@pytest.mark.slow
def test_sampled_speculation_with_a_moe_target_follows_its_distribution(tmp_path):
    """Vocabulary of 8, Qwen2-MoE (shared expert + gate): the joint law of the first two tokens
    under speculation (the second from a verify step) is the target's p(t1) p(t2 | t1)."""
    from helpers import two_token_law

    d = make_moe_model(tmp_path / "v8", "qwen2_moe", vocab_size=8, init_std=0.1)
    head = make_eagle3_head(tmp_path / "h8", d)
    n = 2000
    pvalue, llm = two_token_law(d, head, n)
    st = llm.stats()
    assert st["verify_steps"] >= n and 0 < st["accepted_tokens"] < st["draft_tokens"]
    assert pvalue > 1e-3
