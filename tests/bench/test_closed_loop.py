"""benchmarks/closed_loop.py on the CPU with the tiny shape: every request of the closed loop
completes, with the counts and shares the device runs report."""
from __future__ import annotations

import json

from helpers import load_benchmark


def test_closed_loop_counts(tmp_path):
    cl = load_benchmark("closed_loop")
    out = tmp_path / "cl.json"
    assert cl.main(["--shape", "tiny", "--device", "cpu", "--concurrency", "4", "--requests", "10",
                    "--input-len", "24", "--output-len", "6", "--thresholds", "0,64", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"0", "64"}
    for r in res["runs"].values():
        assert r["requests"] == 10 and r["concurrency"] == 4
        # 10 requests x 6 tokens need at least 15 steps of 4 decoding rows (each step one token)
        assert r["steps"] >= 15 and 0 < r["prefill_step_share"] <= 1
        assert r["output_tok_s"] > 0 and r["mean_ttft_ms"] > 0 and r["p99_ttft_ms"] >= r["mean_ttft_ms"] * 0.5
        assert r["mean_tpot_ms"] is not None
    assert res["ratios_vs_first"]["0"]["output_tok_s"] == 1.0
