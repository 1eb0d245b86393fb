#!/usr/bin/env bash
# Device call 3 of session 10 (2026-12-03): issue 19 after the catch-up fixes (prompts refresh
# the draft whatever the policy says; auto keeps decode rows fresh near its break-even; catch-ups
# priced fixed + per row; probes from off at their own depth). The demo pair offline and served
# at concurrency 1 (auto as `adaspec serve` runs it, and at chain 4), then the CUDA tests.
. benchmarks/device_preamble.sh call3
part 90 demo_c1 python3 benchmarks/demo_c1.py --configs off,chain4,auto --rounds 2 --repeat 3 --out $R/demo_c1.json
part 230 demo_compare python3 -m adaspec.cli compare \
    --configs "off,always,auto,autodefault=auto[--num-steps 3],off2=off,auto2=auto" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/demo_compare
part 130 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_cuda.py
grep -E "mean" $R/demo_c1.log; tail -n 11 $R/demo_compare.log; grep -h "shutdown" $R/demo_compare/server-auto*.log | cut -c1-400; tail -n 2 $R/gpu_tests.log
