#!/usr/bin/env bash
# Device call 1 of session 7 (2026-12-02): the fused-MoE launch table, swept stage by stage (both
# alignments, gate/up and down each with its own tile, the reduction) for both paths, the small
# path's first measured table; the MoE fast path at b = 1..256 with that table against the
# roofline (and a kernel profile); the bundled demo pair served at concurrency 1 (issue 19).
. benchmarks/device_preamble.sh call1
part 90 kernel_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_moe_gpu.py -k kernel -x
part 60 align_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/layers/test_moe_layer.py -k "alignment or launch_parameters"
(cd benchmarks/kernels && part 230 moe_sweep python3 moe_sweep.py --json $R/moe_sweep.json \
    --configs-out $R/moe_configs.json --budget-s 200)
[ -s $R/moe_configs.json ] && cp $R/moe_configs.json adaspec/layers/moe/moe_configs.json
part 40 moe_physics python3 .carry/tools/moe_physics_probe.py --batch 1,16,64,256 --q 1,4 --ctx 512 --json $R/moe_physics.json
part 170 moe_fast_path python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics $R/moe_physics.json \
    --physics-key roofline_ms --batches 1,16,64,256 --configs off,chain3 --skip generate,throughput --profile \
    --out $R/moe_fast_path.json
part 100 demo_compare python3 -m adaspec.cli compare --configs off,always,auto --concurrency 1 \
    --dataset tests/data/demo_heldout.jsonl --output-len 64 --num-prompts 16 --num-warmup 1 --num-steps 4 \
    --device cuda --out-dir $R/demo_compare
grep -E "^T=|BM=" $R/moe_sweep.log | tail -40; grep -iE "ratio|step" $R/moe_fast_path.log | tail -20; tail -n 15 $R/demo_compare.log
