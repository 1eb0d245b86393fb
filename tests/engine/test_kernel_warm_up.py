"""The start-up kernel warm-up reaches every part it names: a model's own launch buckets get the
engine's largest step (the scheduler's token budget), without an error swallowed on the way
(from session 7 to 8 a wrong attribute made the MoE buckets and the shift kernels compile in
the middle of serving, and only a warning said so)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from adaspec.config import EngineConfig
from adaspec.engine.kernel_warm_up import warm_up_kernels


def test_model_buckets_are_warmed_up_to_the_scheduler_budget(monkeypatch, caplog):
    cfg = EngineConfig.create("fake-model", max_num_batched_tokens=3072)
    asked = []
    model = SimpleNamespace(warm_up_kernels=lambda max_tokens: asked.append(max_tokens) or 5)
    backend = SimpleNamespace(warm_up=lambda *a: 3)
    runner = SimpleNamespace(cfg=cfg, model=model, backend=backend, draft=None, dtype=torch.float32,
                             local_spec=SimpleNamespace(num_heads=4), kv_caches=[None],
                             model_spec=SimpleNamespace(sliding_windows=()), rows=SimpleNamespace(block_table=None),
                             block_size=16)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    with caplog.at_level(logging.INFO, logger="adaspec"):
        warm_up_kernels(runner)
    assert asked == [3072]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "8 launches" in caplog.text
