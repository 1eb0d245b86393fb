"""Published EAGLE-3 head layouts: each is written here by its own writer, following the
upstream definition (EAGLE's cnets, SpecForge's LlamaForCausalLMEagle3, vLLM's
llama_eagle3, speculators' Eagle3DraftModel), never through adaspec's helpers. A head either
proposes the same drafts as an independent reference forward of its variant, or is refused
with an error naming the key. Also: .bin targets, generation-config sampling defaults."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from adaspec import LLM, SamplingParams

H, NH, NKV, HD, INTER, V, L = 64, 4, 2, 16, 96, 320, 4  # the draft's shape; target: conftest's llama
THETA, EPS = 10000.0, 1e-6
STEPS = 3


# ---- writers ------------------------------------------------------------------------------------

def _draft_llama_fields(num_layers: int = 1) -> dict:
    return {"hidden_size": H, "intermediate_size": INTER, "num_attention_heads": NH, "num_key_value_heads": NKV,
            "num_hidden_layers": num_layers, "vocab_size": V, "rms_norm_eps": EPS, "rope_theta": THETA,
            "max_position_embeddings": 512, "hidden_act": "silu", "model_type": "llama", "head_dim": HD}


def _norm_w(g, n):
    return 1.0 + 0.5 * torch.randn(n, generator=g)  # far from 1, so a skipped norm shows


def _layer(prefix: str, g, in_dim: int, eagle_first: bool) -> dict:
    """A Llama decoder layer; EAGLE-3's first layer reads 2H and has hidden_norm."""
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    t = {
        f"{prefix}self_attn.q_proj.weight": r(NH * HD, in_dim),
        f"{prefix}self_attn.k_proj.weight": r(NKV * HD, in_dim),
        f"{prefix}self_attn.v_proj.weight": r(NKV * HD, in_dim),
        f"{prefix}self_attn.o_proj.weight": r(H, NH * HD),
        f"{prefix}mlp.gate_proj.weight": r(INTER, H),
        f"{prefix}mlp.up_proj.weight": r(INTER, H),
        f"{prefix}mlp.down_proj.weight": r(H, INTER),
        f"{prefix}input_layernorm.weight": _norm_w(g, H),
        f"{prefix}post_attention_layernorm.weight": _norm_w(g, H),
    }
    if eagle_first:
        t[f"{prefix}hidden_norm.weight"] = _norm_w(g, H)
    return t


def _vocab_maps(g, draft_vocab: int) -> dict:
    """EAGLE's d2t (int64 offsets: target = draft + d2t[draft]) and t2d (bool over the target)."""
    ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(draft_vocab), "t2d": t2d}


def _head_tensors(g, *, first: str, later: str | None = None, num_layers: int = 1, draft_vocab: int = V,
                  num_aux: int = 3) -> dict:
    t = {"fc.weight": torch.randn(H, num_aux * H, generator=g) * 0.2,
         "norm.weight": _norm_w(g, H),
         "lm_head.weight": torch.randn(draft_vocab, H, generator=g) * 0.2}
    t.update(_layer(first, g, 2 * H, True))
    for i in range(1, num_layers):
        t.update(_layer(later.format(i), g, H, False))
    if draft_vocab != V:
        t.update(_vocab_maps(g, draft_vocab))
    return t


def write_eagle_original(path: Path, seed: int = 1, extra: dict | None = None) -> Path:
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: a LlamaForCausalLM config with draft_vocab_size,
    fp16 tensors (int64 d2t, bool t2d) in pytorch_model.bin, no embedding."""
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    cfg = {"architectures": ["LlamaForCausalLM"], "bias": False, "draft_vocab_size": 200,
           "torch_dtype": "float16", **_draft_llama_fields(), **(extra or {})}
    (path / "config.json").write_text(json.dumps(cfg))
    sd = _head_tensors(g, first="midlayer.", draft_vocab=200)
    sd = {k: (v.half() if v.is_floating_point() else v) for k, v in sd.items()}
    torch.save(sd, path / "pytorch_model.bin")
    return path


def write_specforge(path: Path, target_embed: torch.Tensor, *, fc_norm: bool, norm_output: bool | None,
                    aux_output_ids: list[int], seed: int = 2, extra: dict | None = None) -> Path:
    """SpecForge (EAGLE-3.1 when fc_norm): LlamaForCausalLMEagle3, safetensors in two shards with
    an index, a verbatim copy of the target's embedding, eagle_config aux ids (layer outputs)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 160, "fc_norm": fc_norm,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_output_ids}, **_draft_llama_fields()}
    if norm_output is not None:
        cfg["norm_output"] = norm_output
    (path / "config.json").write_text(json.dumps(cfg))
    sd = _head_tensors(g, first="midlayer.", draft_vocab=160)
    if fc_norm:
        sd.update({f"fc_norm.{i}.weight": _norm_w(g, H) for i in range(3)})
    sd["embed_tokens.weight"] = target_embed.clone()
    sd.update(extra or {})
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for f, ks in shards.items():
        save_file({k: sd[k].contiguous() for k in ks}, str(path / f))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    return path


def write_vllm(path: Path, *, num_layers: int, aux_input_ids: list[int], seed: int = 3) -> Path:
    """vLLM's Eagle3LlamaForCausalLM reading: norm_before_residual, layers.{i}.* (layer 0 takes
    2H), top-level eagle_aux_hidden_state_layer_ids naming layer inputs, full vocabulary."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    cfg = {"architectures": ["Eagle3LlamaForCausalLM"], "norm_before_residual": True,
           "eagle_aux_hidden_state_layer_ids": aux_input_ids, **_draft_llama_fields(num_layers)}
    (path / "config.json").write_text(json.dumps(cfg))
    sd = _head_tensors(g, first="layers.0.", later="layers.{}.", num_layers=num_layers, num_aux=len(aux_input_ids))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    return path


# speculators' transformer_layer_config per draft layer kind (Qwen3: its default, with q/k norms).
LAYER_CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
              "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28},
}


def write_speculators(path: Path, target_embed: torch.Tensor, *, norm_before_fc: bool, fc_norm: bool,
                      norm_output: bool, embed_requires_grad: bool, aux_input_ids: list[int], seed: int = 4,
                      model_type: str = "eagle3", layer: str = "llama", layer_extra: dict | None = None,
                      extra_cfg: dict | None = None) -> Path:
    """speculators' Eagle3Speculator: Llama (or Qwen3) fields under transformer_layer_config,
    layers.{i}.*, embed_tokens saved (the target's copy unless embed_requires_grad),
    input_norm / fc_norm; Qwen3 layers carry self_attn.q_norm / k_norm (per head, HD wide)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": model_type,
           "transformer_layer_config": {**_draft_llama_fields(), **LAYER_CONFIGS[layer], **(layer_extra or {})},
           "draft_vocab_size": 200, "norm_before_residual": True, "norm_before_fc": norm_before_fc,
           "fc_norm": fc_norm, "norm_output": norm_output, "embed_requires_grad": embed_requires_grad,
           "eagle_aux_hidden_state_layer_ids": aux_input_ids, "target_hidden_size": None,
           "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "target"}}, **(extra_cfg or {})}
    (path / "config.json").write_text(json.dumps(cfg))
    sd = _head_tensors(g, first="layers.0.", draft_vocab=200, num_aux=len(aux_input_ids))
    if layer == "qwen3":
        sd.update({f"layers.0.self_attn.{n}.weight": _norm_w(g, HD) for n in ("q_norm", "k_norm")})
    if norm_before_fc:
        sd["input_norm.weight"] = _norm_w(g, len(aux_input_ids) * H)
    if fc_norm:
        sd.update({f"fc_norm.{i}.weight": _norm_w(g, H) for i in range(len(aux_input_ids))})
    emb = target_embed.clone()
    if embed_requires_grad:
        emb = emb + 0.3 * torch.randn(emb.shape, generator=g)
    sd["embed_tokens.weight"] = emb
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    return path


# ---- independent reference forward ---------------------------------------------------------------

def _rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x, pos):  # x [T, n, HD], Hugging Face's rotate-half convention
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., HD // 2:], x[..., : HD // 2]], -1)
    return x * cos + rot * sin


def _attn(W, p, x, pos):
    T = x.shape[0]
    q = (x @ W[p + "self_attn.q_proj.weight"].T).view(T, NH, HD)
    k = (x @ W[p + "self_attn.k_proj.weight"].T).view(T, NKV, HD)
    if p + "self_attn.q_norm.weight" in W:  # Qwen3 layers: RMSNorm of each head's q and k, before rotary
        q, k = _rms(q, W[p + "self_attn.q_norm.weight"]), _rms(k, W[p + "self_attn.k_norm.weight"])
    q, k = _rope(q, pos), _rope(k, pos)
    v = (x @ W[p + "self_attn.v_proj.weight"].T).view(T, NKV, HD)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / HD ** 0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, NH * HD)
    return o @ W[p + "self_attn.o_proj.weight"].T


def _mlp(W, p, x):
    g, u = x @ W[p + "mlp.gate_proj.weight"].T, x @ W[p + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ W[p + "mlp.down_proj.weight"].T


def reference_drafts(W: dict, v: dict, embed: torch.Tensor, feats: torch.Tensor, tokens: list[int], steps: int):
    """Greedy chain of `steps` draft tokens after `tokens`, from the target's hidden states
    `feats` [n, k*H] (already the captured layer inputs). `W`: the checkpoint in upstream
    names, `v`: the variant's switches. Full causal recomputation at every step.
    Returns (draft target ids, top-2 margins of each step's logits)."""
    first, later = v["first"], v.get("later")
    n = len(tokens)
    f = feats[: n - 1]
    if v.get("norm_before_fc"):
        f = _rms(f, W["input_norm.weight"])
    if v.get("fc_norm"):
        f = torch.cat([_rms(c, W[f"fc_norm.{i}.weight"]) for i, c in enumerate(f.chunk(v["num_aux"], -1))], -1)
    hs = list(f @ W["fc.weight"].T)           # pair p = (hidden_p, token_{p+1}) at position p
    toks = list(tokens[1:])
    d2t = W.get("d2t")
    out, margins = [], []
    for _ in range(steps):
        h_in, pos = torch.stack(hs), torch.arange(len(hs))
        emb = embed[torch.tensor(toks)]
        x = torch.cat([_rms(emb, W[first + "input_layernorm.weight"]), _rms(h_in, W[first + "hidden_norm.weight"])], -1)
        res = _rms(h_in, W[first + "hidden_norm.weight"]) if v.get("norm_before_residual") else h_in
        h = res + _attn(W, first, x, pos)
        h = h + _mlp(W, first, _rms(h, W[first + "post_attention_layernorm.weight"]))
        for i in range(1, v.get("num_layers", 1)):
            p = later.format(i)
            h = h + _attn(W, p, _rms(h, W[p + "input_layernorm.weight"]), pos)
            h = h + _mlp(W, p, _rms(h, W[p + "post_attention_layernorm.weight"]))
        last = h[-1]
        normed = _rms(last, W["norm.weight"])
        logits = (normed if v.get("norm_logits", True) else last) @ W["lm_head.weight"].T
        top = logits.topk(2)
        margins.append(float(top.values[0] - top.values[1]))
        d = int(top.indices[0])
        t = d + int(d2t[d]) if d2t is not None else d
        out.append(t)
        hs.append(normed if v.get("feed_normed") else last)
        toks.append(t)
    return out, margins


def _checkpoint(path: Path) -> dict:
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    for f in sorted(path.glob("*.bin")):
        sd.update(torch.load(str(f), weights_only=True))
    return {k: (t.float() if t.is_floating_point() else t) for k, t in sd.items()}


@pytest.fixture(scope="module")
def target(llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    return hf, hf.get_input_embeddings().weight.detach().clone()


def _features(hf, tokens: list[int], aux_inputs: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # hs[i] = input of layer i
    return torch.cat([hs[i][0] for i in aux_inputs], -1)


def _check_drafts(llama_dir, target, head_dir: Path, variant: dict, aux_inputs: list[int], embed=None, **engine):
    """adaspec's chain drafts == the reference's, at every speculation step of a generation."""
    hf, target_embed = target
    # overlap=False: the spy reads each request's tokens on the host when its chain is staged
    # (with overlap the token sampled by the step still in flight is not there yet).
    llm = LLM(llama_dir, draft=str(head_dir), speculation="always", num_steps=STEPS, topk=1,
              device="cpu", dtype="float32", overlap=False, **engine)
    head = llm.engine.runner.draft
    assert head.aux_layers == tuple(aux_inputs)
    runner = llm.engine.runner
    seen, pending, stage, run = [], [], runner.chain.stage, runner.chain.run

    def spy_stage(stg, plan, lay, *rest):  # which requests draft, and how deep
        pending[:] = [(list(plan.scheduled[i].req.all_token_ids), lay.reqs[i].depth) for i in lay.drafting]
        return stage(stg, plan, lay, *rest)

    def spy_run(batch):
        out = run(batch)
        seen.extend((toks, row[:depth]) for (toks, depth), row in zip(pending, out.tolist()))

    runner.chain.stage, runner.chain.run = spy_stage, spy_run
    llm.generate([[5, 17, 42, 9, 100, 3, 77, 250, 31]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(seen) >= 2
    W = _checkpoint(head_dir)
    compared = 0
    for tokens, drafts in seen:
        ref, margins = reference_drafts(W, variant, target_embed if embed is None else embed,
                                        _features(hf, tokens, aux_inputs), tokens, STEPS)
        for k in range(len(drafts)):  # the last steps of a request may draft fewer
            assert drafts[k] == ref[k], (head_dir.name, tokens, drafts, ref)
            compared += 1
            if margins[k] < 1e-3:  # a near-tie: later steps may legitimately differ
                break
    assert compared >= len(seen) + 2
    return llm


# ---- the layouts ----------------------------------------------------------------------------------

def test_eagle_original_bin_head(llama_dir, target, tmp_path):
    """yuhuili's layout (LlamaForCausalLM config, fp16 pytorch_model.bin, d2t/t2d, no embedding)
    is recognised by content, loads and drafts like the reference. On this 4-layer target the
    default aux layers (2, L/2, L-3) = (2, 2, 1) repeat a layer, which upstream engines capture
    once: a head whose fc takes three features is refused, by name, not misread."""
    with pytest.raises(ValueError, match="repeat a layer"):
        LLM(llama_dir, draft=str(write_eagle_original(tmp_path / "dup")), speculation="always", device="cpu",
            dtype="float32")
    d = write_eagle_original(tmp_path / "eagle", extra={"eagle_aux_hidden_state_layer_ids": [3, 1, 2]})
    llm = _check_drafts(llama_dir, target, d, {"first": "midlayer."}, [1, 2, 3])   # layer order
    head = llm.engine.runner.draft
    assert head.fmt.layout.startswith("EAGLE original") and head.embed_tokens is None


@pytest.mark.parametrize("fc_norm,norm_output", [(True, None), (False, False)])
def test_specforge_head(llama_dir, target, tmp_path, fc_norm, norm_output):
    """SpecForge EAGLE-3.1 fc_norm, and norm_output=false (lm_head on the un-normed hidden);
    sharded safetensors; aux ids as layer outputs (+1); the saved embedding copy is dropped."""
    d = write_specforge(tmp_path / "sf", target[1], fc_norm=fc_norm, norm_output=norm_output, aux_output_ids=[0, 1, 2])
    v = {"first": "midlayer.", "fc_norm": fc_norm, "num_aux": 3, "norm_logits": norm_output is not False}
    llm = _check_drafts(llama_dir, target, d, v, [1, 2, 3])
    assert llm.engine.runner.draft.embed_tokens is None  # a copy of the target's: the target's is used


def test_vllm_two_layer_head(llama_dir, target, tmp_path):
    """vLLM: two draft layers (one KV cache each), norm_before_residual, two aux layers given as
    layer inputs (no +1). Small blocks and a 4-token budget (prefill in 3 chunks) check that
    the second layer's cache is refreshed across chunks and blocks."""
    d = write_vllm(tmp_path / "vllm", num_layers=2, aux_input_ids=[1, 3])
    v = {"first": "layers.0.", "later": "layers.{}.", "num_layers": 2, "norm_before_residual": True}
    llm = _check_drafts(llama_dir, target, d, v, [1, 3], block_size=4, max_num_batched_tokens=4)
    assert len(llm.engine.runner.draft_cache) == 2


@pytest.mark.parametrize("norm_before_fc,fc_norm,embed_requires_grad", [(True, False, False), (False, True, True)])
def test_speculators_head(llama_dir, target, tmp_path, norm_before_fc, fc_norm, embed_requires_grad):
    """speculators Eagle3Speculator: nested layer config, norm_before_fc / fc_norm,
    norm_output (the normed hidden feeds the next step), and its own trained embedding."""
    d = write_speculators(tmp_path / "spec", target[1], norm_before_fc=norm_before_fc, fc_norm=fc_norm,
                          norm_output=True, embed_requires_grad=embed_requires_grad, aux_input_ids=[0, 2, 3])
    v = {"first": "layers.0.", "norm_before_fc": norm_before_fc, "fc_norm": fc_norm, "num_aux": 3,
         "norm_before_residual": True, "feed_normed": True}
    embed = _checkpoint(d)["embed_tokens.weight"] if embed_requires_grad else None
    llm = _check_drafts(llama_dir, target, d, v, [0, 2, 3], embed=embed)
    assert (llm.engine.runner.draft.embed_tokens is not None) == embed_requires_grad


def test_own_embedding_is_used_when_it_differs(llama_dir, target, tmp_path):
    """A head whose saved embedding is not the target's was trained with it: it is used."""
    emb = target[1] + 0.5 * torch.randn(target[1].shape, generator=torch.Generator().manual_seed(9))
    d = write_specforge(tmp_path / "own", emb, fc_norm=False, norm_output=None, aux_output_ids=[0, 1, 2])
    llm = _check_drafts(llama_dir, target, d, {"first": "midlayer."}, [1, 2, 3], embed=emb)
    assert llm.engine.runner.draft.embed_tokens is not None


def test_lightly_fine_tuned_embedding_is_used(llama_dir, target, tmp_path, caplog):
    """An embedding within 0.1% of the target's is still the head's own (vLLM uses a
    checkpoint's embed_tokens whenever present); only an exact copy, also one rounded to the
    checkpoint's dtype, is dropped. The load log names the embedding used."""
    g = torch.Generator().manual_seed(11)
    emb = target[1] * (1 + 1e-3 * torch.randn(target[1].shape, generator=g))
    d = write_specforge(tmp_path / "tuned", emb, fc_norm=False, norm_output=None, aux_output_ids=[0, 1, 2])
    with caplog.at_level("INFO", logger="adaspec"):
        llm = _check_drafts(llama_dir, target, d, {"first": "midlayer."}, [1, 2, 3], embed=emb)
    assert llm.engine.runner.draft.embed_tokens is not None
    assert "embedding: the head's own embed_tokens" in caplog.text
    caplog.clear()
    half = write_specforge(tmp_path / "half", target[1].half(), fc_norm=False, norm_output=None,
                           aux_output_ids=[0, 1, 2])
    with caplog.at_level("INFO", logger="adaspec"):
        assert _load(llama_dir, half).embed_tokens is None
    assert "exact copy" in caplog.text


def test_speculators_qwen3_layer_head(llama_dir, target, tmp_path):
    """speculators' Qwen3 draft layer: per-head RMSNorm of q and k before rotary."""
    d = write_speculators(tmp_path / "q3", target[1], norm_before_fc=False, fc_norm=False, norm_output=False,
                          embed_requires_grad=False, aux_input_ids=[0, 2, 3], layer="qwen3")
    llm = _check_drafts(llama_dir, target, d, {"first": "layers.0.", "norm_before_residual": True}, [0, 2, 3])
    assert llm.engine.runner.draft.midlayer.self_attn.qk_norm


@pytest.mark.parametrize("layer,layer_extra", [
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ("llama", {"sliding_window": 8, "layer_types": ["sliding_attention"]}),
])
def test_sliding_window_draft_layers_are_refused(llama_dir, target, tmp_path, layer, layer_extra):
    d = write_speculators(tmp_path / "sw", target[1], norm_before_fc=False, fc_norm=False, norm_output=False,
                          embed_requires_grad=False, aux_input_ids=[0, 2, 3], layer=layer, layer_extra=layer_extra)
    with pytest.raises(ValueError, match="sliding-window"):
        _load(llama_dir, d)


def test_specforge_head_converted_by_speculators(llama_dir, target, tmp_path, caplog):
    """A SpecForge EAGLE-3.1 head (fc_norm; norm_output=false: lm_head reads the un-normed
    hidden) converted to speculators' layout keeps SpecForge's meaning of norm_output when the
    config names SpecForge as its source; without that, a warning says how it was read."""
    d = write_speculators(tmp_path / "conv", target[1], norm_before_fc=False, fc_norm=True, norm_output=False,
                          embed_requires_grad=False, aux_input_ids=[1, 2, 3],
                          extra_cfg={"norm_before_residual": False, "source": "SpecForge"})
    v = {"first": "layers.0.", "fc_norm": True, "num_aux": 3, "norm_logits": False}
    llm = _check_drafts(llama_dir, target, d, v, [1, 2, 3])
    fmt = llm.engine.runner.draft.fmt
    assert "SpecForge" in fmt.layout and not fmt.norm_logits and not fmt.feed_normed
    unknown = write_speculators(tmp_path / "unknown", target[1], norm_before_fc=False, fc_norm=True,
                                norm_output=True, embed_requires_grad=False, aux_input_ids=[1, 2, 3])
    with caplog.at_level("WARNING", logger="adaspec"):
        head = _load(llama_dir, unknown)
    assert head.fmt.feed_normed and "SpecForge EAGLE-3.1" in caplog.text


# ---- refusals --------------------------------------------------------------------------------------

def _load(llama_dir, head_dir):
    from adaspec.models.loader import load_model
    from adaspec.spec_decode.eagle3_checkpoint import load_eagle3

    model, spec, _ = load_model(llama_dir, torch.device("cpu"), "float32")
    return load_eagle3(head_dir, spec, model.embed_tokens, torch.device("cpu"), torch.float32)


def _edit_config(d: Path, **changes) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_unimplemented_variants_are_refused_naming_the_key(llama_dir, target, tmp_path):
    emb = target[1]
    extra = write_specforge(tmp_path / "a", emb, fc_norm=False, norm_output=None, aux_output_ids=[0, 1, 2],
                            extra={"midlayer.self_attn.o_proj.bias": torch.zeros(H)})
    with pytest.raises(ValueError, match=r"midlayer\.self_attn\.o_proj\.bias"):
        _load(llama_dir, extra)
    # fc_norm tensors without the config switch would be silently unused.
    quiet = write_specforge(tmp_path / "b", emb, fc_norm=True, norm_output=None, aux_output_ids=[0, 1, 2])
    _edit_config(quiet, fc_norm=False)
    with pytest.raises(ValueError, match=r"fc_norm\.0\.weight"):
        _load(llama_dir, quiet)
    no_aux = _edit_config(write_vllm(tmp_path / "c", num_layers=1, aux_input_ids=[1, 2, 3]),
                          eagle_config={"use_aux_hidden_state": False})
    with pytest.raises(ValueError, match="use_aux_hidden_state"):
        _load(llama_dir, no_aux)
    both = _edit_config(write_vllm(tmp_path / "d", num_layers=1, aux_input_ids=[1, 2, 3]),
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids.*disagree"):
        _load(llama_dir, both)
    outside = _edit_config(write_vllm(tmp_path / "e", num_layers=1, aux_input_ids=[1, 2, 3]),
                           eagle_aux_hidden_state_layer_ids=[1, 2, 9])
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        _load(llama_dir, outside)
    with pytest.raises(ValueError, match="mlp_bias"):
        _load(llama_dir, _edit_config(write_vllm(tmp_path / "f", num_layers=1, aux_input_ids=[1, 2, 3]),
                                      mlp_bias=True))
    eagle1 = write_speculators(tmp_path / "g", emb, norm_before_fc=False, fc_norm=False, norm_output=False,
                               embed_requires_grad=False, aux_input_ids=[0, 2, 3], model_type="eagle")
    with pytest.raises(ValueError, match="speculators_model_type"):
        _load(llama_dir, eagle1)
    bad_t2d = write_eagle_original(tmp_path / "h", extra={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    sd = torch.load(bad_t2d / "pytorch_model.bin", weights_only=True)
    sd["t2d"] = ~sd["t2d"]
    torch.save(sd, bad_t2d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="t2d"):
        _load(llama_dir, bad_t2d)


# ---- .bin targets ---------------------------------------------------------------------------------

def test_bin_targets_load(llama_dir, tmp_path):
    """pytorch_model.bin, single and sharded with its index, gives the same greedy output as the
    safetensors original."""
    from safetensors.torch import load_file

    sd = load_file(str(Path(llama_dir) / "model.safetensors"))
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for d in (single, sharded):
        d.mkdir()
        for f in ("config.json", "generation_config.json"):
            shutil.copy(Path(llama_dir) / f, d / f)
    torch.save(sd, single / "pytorch_model.bin")
    names = sorted(sd)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for f, ks in shards.items():
        torch.save({k: sd[k] for k in ks}, sharded / f)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    prompt = [[3, 14, 15, 92, 65, 35]]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = LLM(llama_dir, device="cpu", dtype="float32").generate(prompt, sp)[0].token_ids
    for d in (single, sharded):
        assert LLM(str(d), device="cpu", dtype="float32").generate(prompt, sp)[0].token_ids == want
    (sharded / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(FileNotFoundError, match="pytorch_model-00002-of-00002.bin"):
        LLM(str(sharded), device="cpu", dtype="float32")


# ---- generation defaults ---------------------------------------------------------------------------

def _with_generation_config(llama_dir, tmp_path, gen: dict) -> str:
    d = tmp_path / "gen"
    shutil.copytree(llama_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1, **gen}))
    return str(d)


def test_generation_config_defaults(llama_dir, tmp_path):
    from adaspec.models.registry import generation_defaults

    d = _with_generation_config(llama_dir, tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                                                      "top_k": 20, "repetition_penalty": 1.1})
    assert generation_defaults(d) == ({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1},
                                      [])
    llm = LLM(d, device="cpu", dtype="float32")
    p = llm.default_sampling_params(max_tokens=5)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.repetition_penalty) == (0.6, 0.9, 20, 0.0, 5, 1.1)
    off = LLM(d, device="cpu", dtype="float32", generation_config="none")
    q = off.default_sampling_params()
    assert off.engine.sampling_defaults == {} and (q.temperature, q.top_p, q.top_k) == (1.0, 1.0, -1)
    with pytest.raises(ValueError, match="generation_config"):
        LLM(d, device="cpu", generation_config="vllm")


def test_generation_config_applies_to_generate(llama_dir, tmp_path):
    """A model whose generation_config.json asks for greedy (top_k 1) decodes greedily when
    generate() gets no SamplingParams; explicit SamplingParams are used as given."""
    d = _with_generation_config(llama_dir, tmp_path, {"top_k": 1, "temperature": 0.7})
    llm = LLM(d, device="cpu", dtype="float32")
    prompts = [[7, 8, 9, 10], [200, 3, 4]]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    assert [o.token_ids for o in llm.generate(prompts)] == [o.token_ids for o in greedy]
    assert llm.default_sampling_params().greedy and not SamplingParams().greedy


def test_server_applies_generation_defaults_per_field():
    """A request's own fields win; the ones it leaves out come from the model's defaults."""
    from types import SimpleNamespace

    from adaspec.server.protocol import ChatCompletionRequest, CompletionRequest
    from adaspec.server.request_params import prepare_choices

    aengine = SimpleNamespace(config=SimpleNamespace(model="m"), tokenizer=None, max_model_len=64,
                              sampling_defaults={"temperature": 0.6, "top_p": 0.9})
    p = prepare_choices(aengine, CompletionRequest(prompt=[1, 2]), [1, 2], 16, "prompt")[0].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.6, 0.9, -1, 0.0)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0.0, top_k=5)
    p = prepare_choices(aengine, req, [1, 2], 16, "messages")[0].params
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.9, 5)
