"""Tiny random models and tokenizers for tests and examples (no hub access needed).

`make_tiny_model(path, arch=...)` writes a Hugging Face directory (config.json,
model.safetensors, generation_config.json and, optionally, a byte-level BPE tokenizer with a
chat template) that both `transformers` and adaspec load. `make_eagle3_head(...)` writes an
EAGLE-3 head in the SpecForge / SGLang layout for a given target.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ARCH_CONFIGS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "llama3": ("LlamaForCausalLM", "LlamaConfig", {
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}),
    # Variants real checkpoints use: biases on every Llama projection (attention_bias also puts
    # one on o_proj; mlp_bias on gate/up/down), and YaRN long-context rope on Qwen3.
    "llama_bias": ("LlamaForCausalLM", "LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "qwen3_yarn": ("Qwen3ForCausalLM", "Qwen3Config", {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
    # Phi-3 / Phi-4: q/k/v and gate/up fused in the checkpoint; a partial rotary variant too.
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {"sliding_window": None}),
    "phi3_partial": ("Phi3ForCausalLM", "Phi3Config", {"sliding_window": None, "partial_rotary_factor": 0.5}),
    # Phi-3-*-128k / Phi-4-mini's longrope (original context 32: a 40-token prompt's output crosses it).
    "phi3_longrope": ("Phi3ForCausalLM", "Phi3Config", {
        "sliding_window": None, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 32,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.5, 3.0, 6.0, 9.0]}}),
}

# Plain turns render as <|role|>content</s>. Tool-capable (Hermes style): the tool definitions
# in a system turn, assistant tool calls as <tool_call>{"name", "arguments"}</tool_call>, tool
# turns as <|tool|>; `continue_final` leaves the last turn open, `greet` appends HI (template
# switches for the tests of chat_template_kwargs).
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t | tojson }}{% endfor %}</s>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|assistant|>{% for c in m['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}</s>"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}</s>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% if not (loop.last and continue_final) %}</s>{% endif %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}{% if greet %}HI{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and verifies them in one forward pass. ",
    "Hello world! How are you today? I am fine, thank you. ",
    "café über naïve résumé 日本語 中文 😀 emoji test ",
    "system user assistant <|user|> <|assistant|> <|system|> ",
]


def make_tokenizer(path: str | os.PathLike, vocab_size: int = 320) -> int:
    """Train a byte-level BPE tokenizer into `path`; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return tok.get_vocab_size()


def make_tiny_model(path: str | os.PathLike, arch: str = "llama", *, hidden_size: int = 64,
                    num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, vocab_size: int = 320, max_position: int = 512,
                    tie_word_embeddings: bool = False, tokenizer: bool = False, seed: int = 0,
                    dtype: torch.dtype = torch.float32, shard_bytes: int | None = None,
                    init_std: float = 0.2, eos_token_id: int | None = 1) -> Path:
    """Write a random `arch` model to `path` with transformers' own save_pretrained.

    A larger `init_std` than HF's default keeps the logits peaked enough that greedy
    decoding is not a sequence of near-ties. `shard_bytes` forces a sharded checkpoint.
    """
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        vocab_size = max(vocab_size, make_tokenizer(path, vocab_size))
    arch_name, cfg_name, extra = ARCH_CONFIGS[arch]
    cfg = getattr(transformers, cfg_name)(
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        vocab_size=vocab_size, max_position_embeddings=max_position,
        tie_word_embeddings=tie_word_embeddings, initializer_range=init_std,
        bos_token_id=0, eos_token_id=eos_token_id, pad_token_id=2, **extra)
    if arch == "qwen2":
        cfg.attention_bias = True  # Qwen2 always has qkv bias; make sure it's exercised
    cfg.architectures = [arch_name]
    torch.manual_seed(seed)
    model = getattr(transformers, arch_name)(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    kw = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(str(path), **kw)
    return path


def make_eagle3_head(path: str | os.PathLike, target_dir: str | os.PathLike, *, draft_vocab_size: int | None = None,
                     seed: int = 1, aux_layer_ids: list[int] | None = None, init_std: float = 0.2,
                     state_dict: dict[str, torch.Tensor] | None = None, with_embed: bool = False,
                     torch_dtype: str = "float32", num_layers: int = 1) -> Path:
    """Write an EAGLE-3 head (SpecForge / SGLang layout, through `save_eagle3`) sized for `target_dir`.
    `num_layers` > 1 adds plain Llama decoder layers (layers.{i}.*) above the first.

    `aux_layer_ids` are SpecForge's ids (layer outputs: the input of id + 1 is captured).
    With `state_dict` the given tensors are written instead of random ones; `torch_dtype` is
    what config.json says they are. `draft_vocab_size=None` writes a full-vocabulary head without d2t.
    """
    from adaspec.spec_decode.eagle3_checkpoint import default_aux_layers, distinct_aux_layers, save_eagle3

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    H = tcfg["hidden_size"]
    V = tcfg["vocab_size"]
    nh = tcfg["num_attention_heads"]
    nkv = tcfg.get("num_key_value_heads", nh)
    hd = H // nh
    inter = tcfg["intermediate_size"]
    Vd = draft_vocab_size or V
    if state_dict is None:
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape):
            return torch.randn(*shape, generator=g) * init_std

        state_dict = {
            "fc.weight": rnd(H, 3 * H),
            "midlayer.self_attn.q_proj.weight": rnd(nh * hd, 2 * H),
            "midlayer.self_attn.k_proj.weight": rnd(nkv * hd, 2 * H),
            "midlayer.self_attn.v_proj.weight": rnd(nkv * hd, 2 * H),
            "midlayer.self_attn.o_proj.weight": rnd(H, nh * hd),
            "midlayer.mlp.gate_proj.weight": rnd(inter, H),
            "midlayer.mlp.up_proj.weight": rnd(inter, H),
            "midlayer.mlp.down_proj.weight": rnd(H, inter),
            "midlayer.input_layernorm.weight": torch.ones(H),
            "midlayer.hidden_norm.weight": torch.ones(H),
            "midlayer.post_attention_layernorm.weight": torch.ones(H),
            "norm.weight": torch.ones(H),
            "lm_head.weight": rnd(Vd, H),
        }
        if draft_vocab_size is not None:
            # Draft vocabulary = the first Vd target ids, shuffled, so d2t is non-trivial.
            t_ids = torch.randperm(V, generator=g)[:Vd].sort().values
            state_dict["d2t"] = t_ids - torch.arange(Vd)
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[t_ids] = True
            state_dict["t2d"] = t2d
        if with_embed:
            state_dict["embed_tokens.weight"] = rnd(V, H)
        for i in range(1, num_layers):
            shapes = {"self_attn.q_proj": (nh * hd, H), "self_attn.k_proj": (nkv * hd, H),
                      "self_attn.v_proj": (nkv * hd, H), "self_attn.o_proj": (H, nh * hd),
                      "mlp.gate_proj": (inter, H), "mlp.up_proj": (inter, H), "mlp.down_proj": (H, inter)}
            for name, shape in shapes.items():
                state_dict[f"layers.{i}.{name}.weight"] = rnd(*shape)
            for name in ("input_layernorm", "post_attention_layernorm"):
                state_dict[f"layers.{i}.{name}.weight"] = torch.ones(H)
    if aux_layer_ids is not None:
        aux = tuple(i + 1 for i in aux_layer_ids)
    else:   # the upstream default, unless it repeats a layer of this (small) target
        L = json.loads((Path(target_dir) / "config.json").read_text())["num_hidden_layers"]
        aux = distinct_aux_layers(L)
        aux = None if aux == default_aux_layers(L) else aux
    return save_eagle3(path, target_dir, state_dict, aux_layers=aux, draft_vocab_size=draft_vocab_size,
                       torch_dtype=torch_dtype)


def main(argv: list[str] | None = None) -> int:
    """`python -m adaspec.testing DIR`: write a tiny demo target (with tokenizer) to DIR/target
    and an EAGLE-3 head for it to DIR/draft, for trying the server on any machine."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m adaspec.testing", description=main.__doc__)
    p.add_argument("dir")
    p.add_argument("--arch", default="llama", choices=sorted(ARCH_CONFIGS))
    a = p.parse_args(argv)
    target = make_tiny_model(Path(a.dir) / "target", a.arch, tokenizer=True)
    draft = make_eagle3_head(Path(a.dir) / "draft", target)
    print(f"target: {target}\ndraft:  {draft}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
