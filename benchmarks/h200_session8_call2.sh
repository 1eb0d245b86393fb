#!/usr/bin/env bash
# Device call 2 of session 8 (2026-12-03): part b of the MoE load experiment (thr32, tree16, auto;
# the levels and waves of call 1's part a, whose off and chain3 tables survive only in its log:
# the part ran out of its time limit before it wrote them), with `auto` priced by the engine's
# cadence (engine/step_clock.py); then the bundled demo pair served at concurrency 1 and its
# offline host split (issue 19). The part's directory lives under $R, so a part cut short
# still returns its server logs.
. benchmarks/device_preamble.sh call2
# A fresh Triton cache: each compiled kernel's files carry their compile time, so compiles after
# a server said "serving" show (the off server's TTFT p99 of 8-16 s in call 1).
export TRITON_CACHE_DIR=/tmp/tcache; mkdir -p $TRITON_CACHE_DIR
part 390 load_b python3 benchmarks/load_experiment.py --shape qwen3-30b-a3b --out-dir $R/le --part b \
    --only thr32,tree16,auto --levels 1,16,64,128,256 --waves 3
part 130 demo_compare python3 -m adaspec.cli compare --configs off,always,auto --concurrency 1 \
    --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 32 --num-warmup 2 --num-steps 4 \
    --device cuda --out-dir $R/demo_compare
part 45 host_demo python3 benchmarks/host_profile.py --model demo --configs off,chain4,auto --steps 300 \
    --prompt-len 128 --out $R/host_demo.json
find $TRITON_CACHE_DIR -name "*.json" ! -name "__grp__*" -printf '%TY-%Tm-%Td %TT %f %h\n' | sort > $R/triton_compiles.txt
grep -h "serving\|captured\|warmed" $R/le/part-b/server-*.log > $R/serving_lines.txt 2>/dev/null
tar czf $OUT/call2.tar.gz -C $R .
grep -E "^ +[0-9]+ +[0-9]+ +[0-9]|^==|^--" $R/load_b.log | tail -30; tail -n 12 $R/demo_compare.log; grep -E "^(off|chain|auto)" $R/host_demo.log
