#!/usr/bin/env bash
# Device call 3 of session 7 (2026-12-02): part b of the MoE load experiment (tree16, auto; the
# same levels, waves and code as part a in call 2: .carry/bis/d944e7d = `git archive d944e7d adaspec
# benchmarks/load_experiment.py`, demo weights left out; its servers run that tree), then the MoE fast path at b = 1..256 with the
# chunked alignment from 33 pairs (call 1 ran it from 513) against the roofline.
. benchmarks/device_preamble.sh call3
part 330 load_b python3 .carry/bis/d944e7d/benchmarks/load_experiment.py --shape qwen3-30b-a3b --out-dir /tmp/le --part b \
    --only tree16,auto --levels 1,16,64,128,256 --waves 3 --tar $OUT/load_experiment-b.tar.gz
part 40 moe_physics python3 .carry/tools/moe_physics_probe.py --batch 1,16,64,256 --q 1,4 --ctx 512 --json $R/moe_physics.json
part 150 moe_fast_path python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics $R/moe_physics.json \
    --physics-key roofline_ms --batches 1,16,64,256 --configs off,chain3 --skip generate,throughput \
    --out $R/moe_fast_path.json
tail -n 25 $R/load_b.log; grep -A12 '"1_ratios"' $R/moe_fast_path.log | head -14
