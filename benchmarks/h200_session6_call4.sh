#!/usr/bin/env bash
# Device call 4 of session 6 (2026-12-02): after the GEMV rule (one row; router-sized outputs up to
# 4) and the host-staging merge (host19): chain-3 verify at b = 1 on both shapes against their
# probes; the demo pair's host/device split (off, chain 4, auto; kernel profile); the GPU tests.
. benchmarks/device_preamble.sh call4
part 30 moe_physics python3 .carry/tools/moe_physics_probe.py --batch 1 --q 1,4 --ctx 512 --json $R/moe_physics.json
part 80 moe_chain3 python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics $R/moe_physics.json \
    --physics-key roofline_ms --batches 1 --configs off,chain3 --skip generate,throughput --out $R/moe_chain3.json
part 30 physics python3 .carry/tools/physics_probe.py --batch 1,64 --q 1,4 --ctx 512 --json $R/physics.json
part 80 dense python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --batches 1,64 --configs off,chain3 \
    --skip generate,throughput --out $R/dense.json
part 90 host_demo python3 benchmarks/host_profile.py --model demo --configs off,chain4,auto --steps 200 \
    --prompt-len 128 --kernels --out $R/host_demo.json
part 250 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu tests/layers/test_linear.py \
    tests/layers/test_fused_ops.py tests/engine/test_logprob_kernel.py
