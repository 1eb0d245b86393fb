#!/usr/bin/env bash
# Device call 1 of session 8 (2026-12-03): part a of the MoE load experiment again (session 7's
# device files were lost before they were recorded): off, chain3, thr32 and the offline
# LLM.generate reference, C = 1, 16, 64, 128, 256, 3 waves; then the demo pair's host split per
# step (offline, with a kernel profile) and the demo pair served at concurrency 1 (issue 19).
. benchmarks/device_preamble.sh call1
part 400 load_a python3 benchmarks/load_experiment.py --shape qwen3-30b-a3b --out-dir /tmp/le --part a \
    --only off,chain3,thr32 --levels 1,16,64,128,256 --waves 3 --tar $OUT/load_experiment-a.tar.gz
part 70 host_demo python3 benchmarks/host_profile.py --model demo --configs off,chain4,auto --steps 300 \
    --prompt-len 128 --kernels --out $R/host_demo.json
part 110 demo_compare python3 -m adaspec.cli compare --configs off,always,auto --concurrency 1 \
    --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 32 --num-warmup 2 --num-steps 4 \
    --device cuda --out-dir $R/demo_compare
tail -n 25 $R/load_a.log; grep -E "^(off|chain|auto)" $R/host_demo.log; tail -n 12 $R/demo_compare.log
