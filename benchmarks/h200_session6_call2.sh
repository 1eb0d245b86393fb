#!/usr/bin/env bash
# Device call 2 of session 6 (2026-12-02): issue 20's target 2. The MoE probe's roofline at
# b = 256 (and its GEMM rate), then offline throughput on the Qwen3-30B-A3B shape, 256 x (512 in,
# 256 out), against the bound and against transformers' continuous batching on the same shape.
. benchmarks/device_preamble.sh call2
part 150 moe_physics python3 .carry/tools/moe_physics_probe.py --batch 256 --q 1 --ctx 512 --json $R/moe_physics.json
part 420 moe_offline python3 benchmarks/moe_offline.py --physics $R/moe_physics.json --timeout 200 --out $R/moe_offline.json
