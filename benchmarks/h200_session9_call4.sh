#!/usr/bin/env bash
# Device call 4 of session 9 (2026-12-03): the GPU MoE tests with programmatic dependent launch on
# (kernel conformance, graphs, tiny Qwen3-MoE / GLM-4.5 equal to transformers; call 3's test part
# ran out of time after 26 passes and no failure), the chain-3 verify step at b = 256 that call 3's
# part did not reach, and the bundled demo pair served at concurrency 1 (issue 19: auto vs off).
. benchmarks/device_preamble.sh call4
part 125 gpu_moe_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_moe_gpu.py
part 20 moe_physics python3 .carry/tools/moe_physics_probe.py --batch 256 --q 1,4 --ctx 512 --json $R/moe_physics.json
part 60 moe_verify256 python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics $R/moe_physics.json \
    --physics-key roofline_ms --batches 256 --configs chain3 --skip generate,throughput --out $R/moe_verify256.json
part 150 demo_compare python3 -m adaspec.cli compare --configs off,always,auto --concurrency 1 \
    --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 24 --num-warmup 2 --num-steps 4 \
    --device cuda --out-dir $R/demo_compare
grep -E "passed|failed" $R/gpu_moe_tests.log | tail -2; grep -E "step_ratio" $R/moe_verify256.log | cut -c1-200; tail -n 12 $R/demo_compare.log
