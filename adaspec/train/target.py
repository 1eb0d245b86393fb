"""The frozen target during training: loaded with transformers (float32 master copy, no
grad), and per batch its aux features and logits.

Features are the *inputs* of the target layers `aux_layers` (pre-norm hidden states; index L
= the input of the final norm), captured by forward pre-hooks and concatenated in the order
given, which `config.resolve_aux_layers` makes layer order: what the engine captures at
inference, so the head sees at inference exactly the features it was trained on.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def load_target(target_dir: Path, device: torch.device | str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def decoder(model) -> nn.Module:
    return model.model if hasattr(model, "model") else model.base_model


def autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


class TargetFeatures:
    """Per batch: aux [B, T, k*H] (inputs of `aux_layers`) and logits [B, T, V] of the frozen target."""

    def __init__(self, model, aux_layers: tuple[int, ...]):
        self.model, self.aux_layers = model, aux_layers
        dec = decoder(model)
        layers, L = dec.layers, len(dec.layers)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        for i in set(aux_layers):
            mod = layers[i] if i < L else dec.norm
            self._hooks.append(mod.register_forward_pre_hook(self._grab(i), with_kwargs=True))

    def _grab(self, i):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            self._captured[i] = x.detach()
        return hook

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._captured.clear()
        logits = self.model(input_ids=ids, use_cache=False).logits
        return torch.cat([self._captured[i] for i in self.aux_layers], dim=-1), logits

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def features(model, ids: torch.Tensor, aux_layers: tuple[int, ...], chunk: int = 64):
    """(aux [B, T, len(aux)*H], labels [B, T] = target argmax) for all of `ids`."""
    feats = TargetFeatures(model, aux_layers)
    try:
        outs = [feats(ids[s:s + chunk]) for s in range(0, ids.shape[0], chunk)]
    finally:
        feats.close()
    return torch.cat([a for a, _ in outs]), torch.cat([lg.argmax(-1) for _, lg in outs])
