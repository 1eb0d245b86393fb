"""benchmarks/moe_offline.py: the roofline bound's arithmetic, and the adaspec part on the CPU
with the tiny shape (every requested token generated)."""
from __future__ import annotations

import argparse

import pytest

from helpers import load_benchmark


def test_bound_is_prefill_at_the_gemm_rate_plus_roofline_decode_steps():
    mo = load_benchmark("moe_offline")
    physics = {"active_GB_per_token": 6.0, "gemm_TFLOPs": 800.0, "roofline_ms": {"256x1": 17.0, "64x1": 14.0}}
    a = argparse.Namespace(batch=256, requests=512, input_len=512, output_len=256)
    b = mo.bound(physics, a)
    # 3e9 active parameters, 2 FLOPs each per prompt token; two waves of 256 decode steps
    assert b["prefill_s"] == pytest.approx(2 * 3e9 * 512 * 512 / 800e12)
    assert b["decode_s"] == pytest.approx(2 * 256 * 17.0 / 1e3)
    assert b["tok_s"] == pytest.approx(512 * 256 / (b["prefill_s"] + b["decode_s"]))
    small = mo.bound(physics, argparse.Namespace(batch=256, requests=64, input_len=512, output_len=256))
    assert small["batch"] == 64 and small["decode_step_ms"] == 14.0


def test_adaspec_part_generates_every_token():
    mo = load_benchmark("moe_offline")
    a = argparse.Namespace(shape="tiny", device="cpu", requests=3, batch=2, input_len=12, output_len=5)
    r = mo.run_adaspec(a)
    assert r["output_tokens"] == 15 and r["tok_s"] > 0
