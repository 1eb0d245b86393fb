"""FP8 checkpoints as they are published (models/quantized.py): block-scaled `fp8` (Qwen3-*-FP8,
DeepSeek-V3), llm-compressor's `compressed-tensors` (per tensor, per channel, per block) and
Meta's `fbgemm_fp8`, dense and mixture-of-experts, dequantized at load. The model they load is
the checkpoint's dequantized model, weight for weight; transformers runs the same model from
the same files (it dequantizes where it has no FP8 kernels), token for token. Any other
quantization method is a load error that names it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adaspec import LLM, SamplingParams
from adaspec.models.loader import load_model
from adaspec.models.quantized import dequantize, read_quantization
from adaspec.testing import make_eagle3_head, make_tiny_model
from helpers import MAX_NEW, assert_matches_reference, hf_greedy, prompts_of_lengths
from fp8_checkpoints import FORMATS, quantize, write_fp8
from moe_models import make_moe_model

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
def _params(model_dir, shard=None) -> dict:
    model, _, _ = load_model(model_dir, torch.device("cpu"), "float32", shard=shard)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """120 MLP rows: the 32-row blocks of `fp8_block` end in a partial one."""
    return make_tiny_model(tmp_path_factory.mktemp("fp8") / "llama", "llama", intermediate_size=120)


@pytest.fixture(scope="module")
def llama_whole_blocks(tmp_path_factory):
    """transformers reads a block's size off the scale grid (weight rows / grid rows), so its
    dequantization is right only where blocks tile the weight exactly, as in published files."""
    return make_tiny_model(tmp_path_factory.mktemp("fp8") / "llama128", "llama", intermediate_size=128)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_loads_the_dequantized_model_and_drops_activation_scales(fmt, llama, tmp_path, caplog):
    d = write_fp8(llama, tmp_path / fmt, fmt, split_scales=fmt == "ct_block")
    with caplog.at_level("WARNING", logger="adaspec"):
        got = _params(d)
    assert "not read" not in caplog.text   # input/k scales are dropped on purpose, not reported
    want = _params(Path(f"{d}_ref"))
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n
    # and it is not the plain model: the FP8 rounding is really in there
    assert not torch.equal(got["layers.0.mlp.down_proj.weight"], _params(llama)["layers.0.mlp.down_proj.weight"])


def test_block_fp8_equals_transformers_and_speculation_stays_lossless(llama_whole_blocks, tmp_path):
    d = write_fp8(llama_whole_blocks, tmp_path / "q", "fp8_block")
    prompts = prompts_of_lengths([7, 30], seed=3)
    plain = LLM(str(d), device="cpu", dtype="float32").generate(prompts, GREEDY)
    for p, o in zip(prompts, plain):
        ref, logits = hf_greedy(str(d), p, MAX_NEW)   # transformers dequantizes on a CPU
        assert assert_matches_reference(o.token_ids, ref, logits, "fp8") >= MAX_NEW // 2
    head = make_eagle3_head(tmp_path / "head", d)
    spec = LLM(str(d), draft=str(head), speculation="always", num_steps=3, device="cpu", dtype="float32")
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == [o.token_ids for o in plain]


def test_moe_experts_in_fp8_equal_transformers(tmp_path):
    src = make_moe_model(tmp_path / "moe", "qwen3_moe")
    d = write_fp8(src, tmp_path / "q", "fp8_block")
    want = _params(Path(f"{d}_ref"))
    got = _params(d)
    assert all(torch.equal(got[n], want[n]) for n in want)
    prompts = prompts_of_lengths([11], seed=5)
    out = LLM(str(d), device="cpu", dtype="float32").generate(prompts, GREEDY)[0]
    ref, logits = hf_greedy(str(d), prompts[0], MAX_NEW)
    assert assert_matches_reference(out.token_ids, ref, logits, "fp8 moe") >= MAX_NEW // 2
    # Shards, experts cut or whole (expert parallelism: a rank skips the others' weights and
    # scales alike), equal the same shards of the dequantized reference.
    from adaspec.parallel.shard import Shard

    for shard in (Shard(1, 2), Shard(1, 2, expert_parallel=True)):
        got, want = _params(d, shard), _params(Path(f"{d}_ref"), shard)
        assert all(torch.equal(got[n], want[n]) for n in want), shard


def test_tensor_parallel_shards_are_cut_from_the_dequantized_weights(llama, tmp_path):
    from adaspec.parallel.shard import Shard

    d = write_fp8(llama, tmp_path / "q", "fp8_block")   # 32-row blocks: a rank's rows cut through them
    full = _params(Path(f"{d}_ref"))
    for rank in range(2):
        shard = Shard(rank, 2)
        got, ref = _params(d, shard), _params(Path(f"{d}_ref"), shard)
        assert got.keys() == ref.keys()
        for n in ref:
            assert torch.equal(got[n], ref[n]), (rank, n)
        assert got["layers.0.mlp.down_proj.weight"].shape[1] < full["layers.0.mlp.down_proj.weight"].shape[1]


def test_dequantize_partial_edge_blocks_and_e8m0_scales():
    torch.manual_seed(0)
    w = (torch.randn(50, 70) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(4, 3) + 0.5                      # 16 x 32 blocks: the last row / column blocks are partial
    want = torch.empty(50, 70)
    for i in range(50):
        for j in range(70):
            want[i, j] = float(w[i, j].float()) * float(s[i // 16, j // 32])
    assert torch.equal(dequantize(w, s, (16, 32), "w"), want)
    e8m0 = torch.tensor([[120, 127], [130, 127]], dtype=torch.uint8)   # 2 ** (byte - 127)
    x = torch.ones(4, 4).to(torch.float8_e4m3fn)
    assert dequantize(x, e8m0, (2, 2), "x")[:, 0].tolist() == [2.0 ** -7] * 2 + [8.0] * 2
    with pytest.raises(ValueError, match="does not tile"):
        dequantize(w, s, (32, 32), "w")
    with pytest.raises(ValueError, match="no block size"):
        dequantize(w, s, None, "w")


@pytest.mark.parametrize("qcfg, match", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
    ({"quant_method": "mxfp4"}, "'mxfp4'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}}, "format 'int-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}}, "8-bit int weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}}, "'group'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
])
def test_methods_adaspec_cannot_read_are_load_errors_naming_them(qcfg, match, llama, tmp_path):
    assert read_quantization({}) is None
    with pytest.raises(ValueError, match=match):
        read_quantization({"quantization_config": qcfg})
    d = tmp_path / "m"
    shutil.copytree(llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(d), device="cpu", dtype="float32")


def test_a_float8_weight_without_its_scale_is_a_load_error(llama, tmp_path):
    d = write_fp8(llama, tmp_path / "q", "fp8_block")
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.o_proj\.weight.*no weight_scale"):
        LLM(str(d), device="cpu", dtype="float32")


def test_vllm_quantization_argument_names_the_checkpoints_own_method(llama, tmp_path):
    import subprocess
    import sys

    d = write_fp8(llama, tmp_path / "q", "ct_channel")
    prompt = prompts_of_lengths([6], seed=1)
    want = LLM(str(d), device="cpu", dtype="float32").generate(prompt, GREEDY)[0].token_ids
    assert LLM(str(d), quantization="compressed-tensors", device="cpu", dtype="float32").generate(
        prompt, GREEDY)[0].token_ids == want
    with pytest.raises(ValueError, match="'fp8'.*compressed-tensors checkpoint.*does not quantize"):
        LLM(str(d), quantization="fp8", device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="unquantized checkpoint"):
        LLM(str(llama), quantization="fp8", device="cpu", dtype="float32")
    out = subprocess.run([sys.executable, "-m", "adaspec.cli", "serve", "--model", str(llama), "--device", "cpu",
                          "--quantization", "fp8"], cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--quantization" in out.stderr and "unquantized" in out.stderr


def test_an_fp8_head_loads_dequantized_and_drafts_as_its_dequantized_twin(llama_whole_blocks, tmp_path):
    """Heads are read through the same stream: a head published in FP8 drafts exactly as the
    float head holding weight x scale does (a speculative run equal token for token)."""
    head = make_eagle3_head(tmp_path / "head", llama_whole_blocks)
    qcfg, grain, suffix, _ = FORMATS["fp8_block"]
    sd = load_file(str(head / "model.safetensors"))
    out, twin = {}, {}
    for name, w in sd.items():
        if name.startswith("midlayer.") and name.endswith("_proj.weight"):
            q, s, full = quantize(w.float(), grain)
            out[name], out[name[: -len("weight")] + suffix], twin[name] = q, s, q.float() * full
        else:
            out[name] = twin[name] = w
    fp8_head = tmp_path / "fp8_head"
    shutil.copytree(head, fp8_head)
    cfg = json.loads((fp8_head / "config.json").read_text())
    (fp8_head / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    save_file(out, str(fp8_head / "model.safetensors"))
    save_file(twin, str(head / "model.safetensors"))
    prompts = prompts_of_lengths([9, 14], seed=2)
    runs = [LLM(str(llama_whole_blocks), draft=str(h), speculation="always", num_steps=3, device="cpu",
                dtype="float32") for h in (fp8_head, head)]
    outs = [llm.generate(prompts, GREEDY) for llm in runs]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    fp8_accepted, twin_accepted = (llm.stats()["accepted_tokens"] for llm in runs)
    assert fp8_accepted == twin_accepted > 0
