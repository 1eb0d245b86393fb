#!/usr/bin/env bash
# Device call 1 of session 9 (2026-12-03): issue 20 target 1 measured again (session 7's figures
# were lost): the MoE roofline probe, then the whole engine step at b = 1, 16, 64, 256 for decode
# and chain-3 verify against it, with a kernel profile at every batch (what eats the difference).
. benchmarks/device_preamble.sh call1
part 60 moe_physics python3 .carry/tools/moe_physics_probe.py --batch 1,16,64,256 --q 1,4 --ctx 512 --json $R/moe_physics.json
part 330 moe_fast_path python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics $R/moe_physics.json \
    --physics-key roofline_ms --batches 1,16,64,256 --configs off,chain3 --skip generate,throughput --profile \
    --profile-batches 1,16,64,256 --out $R/moe_fast_path.json
cp $R/moe_fast_path.json $OUT/ 2>/dev/null
grep -A12 '"1_ratios"' $R/moe_fast_path.json | head -14
