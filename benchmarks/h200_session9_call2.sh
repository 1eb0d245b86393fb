#!/usr/bin/env bash
# Device call 2 of session 9 (2026-12-03): the attention launch table for the Qwen3-30B-A3B heads
# (32 q / 4 kv: the sweep writes adaspec/layers/attention/attention_configs.json, which every later
# part reads), the rotary kernel with a block of heads per program; kernel tests on the GPU; then
# the MoE fast path against its roofline (issue 20 target 1) and the dense fast path against
# physics_probe (issue 19: within 2% of fast_path_closing), with kernel profiles.
. benchmarks/device_preamble.sh call2
part 120 kernel_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/layers/test_attention_backends.py \
    tests/layers/test_fused_ops.py tests/layers/test_attention_launch_table.py -x
(cd benchmarks/kernels && part 170 attn_sweep python3 attention_sweep.py --json $R/moe_attn_sweep.json --heads 32,4 \
    --chain --shapes 1x1,16x1,64x1,256x1,1x4,16x4,64x4,256x4 --budget-s 150 \
    --table-out $PWD/../../adaspec/layers/attention/attention_configs.json)
cp adaspec/layers/attention/attention_configs.json $R/ 2>/dev/null; cp $R/attention_configs.json $OUT/ 2>/dev/null
part 40 moe_physics python3 .carry/tools/moe_physics_probe.py --batch 1,16,64,256 --q 1,4 --ctx 512 --json $R/moe_physics.json
part 150 moe_fast_path python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics $R/moe_physics.json \
    --physics-key roofline_ms --batches 1,16,64,256 --configs off,chain3 --skip generate,throughput --profile \
    --profile-batches 1,256 --out $R/moe_fast_path.json
part 40 physics python3 .carry/tools/physics_probe.py --batch 1,16,64,256 --q 1,4,16 --ctx 512 --json $R/physics.json
part 150 dense_fast_path python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --configs off,chain3,tree16 \
    --skip generate,throughput --out $R/dense_fast_path.json
grep -E "passed|failed" $R/kernel_tests.log | tail -2; grep -E "^b=|us  bq" $R/attn_sweep.log | head -24
grep -A12 '"1_ratios"' $R/moe_fast_path.json | head -20; grep -A14 '"1_ratios"' $R/dense_fast_path.json | head -24
