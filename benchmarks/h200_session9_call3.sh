#!/usr/bin/env bash
# Device call 3 of session 9 (2026-12-03): programmatic dependent launch (layers/pdl.py) and the
# rotary kernel's per-head mode for small grids, measured A/B in one call (ADASPEC_PDL=0 is the
# reference): the MoE fast path against its roofline (issue 20 target 1) and the dense fast
# path against physics_probe; the kernel tests and the GPU engine tests with PDL on.
. benchmarks/device_preamble.sh call3
part 100 kernel_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/layers -x
part 20 moe_physics python3 .carry/tools/moe_physics_probe.py --batch 1,16,64,256 --q 1,4 --ctx 512 --json $R/moe_physics.json
part 90 moe_pdl python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics $R/moe_physics.json \
    --physics-key roofline_ms --batches 1,16,64,256 --configs off,chain3 --skip generate,throughput --profile \
    --profile-batches 1 --out $R/moe_pdl.json
ADASPEC_PDL=0 part 60 moe_nopdl python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics $R/moe_physics.json \
    --physics-key roofline_ms --batches 1,16 --configs off,chain3 --skip generate,throughput --out $R/moe_nopdl.json
part 20 physics python3 .carry/tools/physics_probe.py --batch 1,16,64,256 --q 1,4,16 --ctx 512 --json $R/physics.json
part 80 dense_pdl python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --configs off,chain3,tree16 \
    --skip generate,throughput --out $R/dense_pdl.json
ADASPEC_PDL=0 part 50 dense_nopdl python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --configs off,chain3 \
    --batches 1,16 --skip generate,throughput --out $R/dense_nopdl.json
part 200 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_cuda.py tests/gpu/test_moe_gpu.py
grep -E "passed|failed" $R/kernel_tests.log $R/gpu_tests.log | tail -4
for f in moe_pdl moe_nopdl dense_pdl dense_nopdl; do echo $f; grep -A30 '"1_ratios"' $R/$f.json | tr -d ' \n' | head -c 700; echo; done
