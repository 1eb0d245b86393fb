"""Heads the trainer writes run on the layers they were trained on in SGLang and vLLM too
(issue 26, items 2 and 3): each layer captured once, in layer order, and the ids written
where each engine reads them. The readers below follow the engines' own rules, not adaspec's
loader."""
from __future__ import annotations

import json

import pytest

from adaspec import LLM, SamplingParams
from adaspec.testing import make_tiny_model
from adaspec.train import train_eagle3_head

QUICK = dict(steps=2, seq_len=16, batch_size=4, num_sequences=8, ttt_steps=2, prompt_len=4, num_threads=1)


def vllm_aux_layers(draft_cfg: dict, num_target_layers: int) -> tuple[int, ...]:
    """vLLM (`get_eagle3_aux_layers_from_config`): the draft config's top-level
    `eagle_aux_hidden_state_layer_ids`, layer inputs; absent, the target's default."""
    ids = draft_cfg.get("eagle_aux_hidden_state_layer_ids")
    L = num_target_layers
    return tuple(ids) if ids else (2, L // 2, L - 3)


def sglang_aux_layers(draft_cfg: dict, num_target_layers: int) -> tuple[int, ...]:
    """SGLang: `eagle_config.eagle_aux_hidden_state_layer_ids` are layer outputs (it captures
    the input of id + 1); absent, the same default."""
    ids = (draft_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    L = num_target_layers
    return tuple(i + 1 for i in ids) if ids else (2, L // 2, L - 3)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    return {n: str(make_tiny_model(root / f"l{n}", "llama", num_layers=n, init_std=0.05)) for n in (6, 8)}


def _train(target, out, **kw):
    res = train_eagle3_head(target, out, **QUICK, **kw)
    return res, json.loads((out / "config.json").read_text())


def _fc_inputs(head_dir) -> int:
    from safetensors.torch import load_file

    return load_file(str(head_dir / "model.safetensors"))["fc.weight"].shape[1]


def test_small_target_default_captures_three_distinct_layers(targets, tmp_path):
    """6 layers: upstream's default (2, 3, 3) repeats layer 3, which vLLM and SGLang capture
    once (an fc input of 2H for a head trained on 3H). The trainer picks three distinct
    layers and writes them, so every engine feeds the head what it was trained on."""
    out = tmp_path / "h6"
    res, cfg = _train(targets[6], out)
    H = json.loads(open(f"{targets[6]}/config.json").read())["hidden_size"]
    layers = tuple(res["aux_layers"])
    assert len(set(layers)) == 3 and list(layers) == sorted(layers)
    for read in (vllm_aux_layers, sglang_aux_layers):
        assert read(cfg, 6) == layers
    assert _fc_inputs(out) == len(set(layers)) * H
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(targets[6], device="cpu", dtype="float32").generate(prompts, sp)]
    spec = LLM(targets[6], draft=str(out), speculation="always", num_steps=2, device="cpu", dtype="float32")
    assert spec.engine.runner.draft.aux_layers == layers
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want


def test_repeated_aux_layers_are_refused(targets, tmp_path):
    with pytest.raises(ValueError, match="repeat"):
        train_eagle3_head(targets[8], tmp_path / "dup", aux_layers=(1, 4, 4), **QUICK)


def test_custom_aux_layers_are_written_for_vllm_and_sglang(targets, tmp_path):
    """Given out of order, trained and written in layer order, under both keys."""
    res, cfg = _train(targets[8], tmp_path / "custom", aux_layers=(6, 1, 3))
    assert res["aux_layers"] == [1, 3, 6]
    assert vllm_aux_layers(cfg, 8) == (1, 3, 6) and sglang_aux_layers(cfg, 8) == (1, 3, 6)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]


def test_upstream_default_is_not_written(targets, tmp_path):
    """8 layers: the default (2, 4, 5) is what every engine assumes; nothing is written."""
    res, cfg = _train(targets[8], tmp_path / "default")
    assert res["aux_layers"] == [2, 4, 5]
    assert "eagle_config" not in cfg and "eagle_aux_hidden_state_layer_ids" not in cfg
    assert vllm_aux_layers(cfg, 8) == (2, 4, 5) == sglang_aux_layers(cfg, 8)
