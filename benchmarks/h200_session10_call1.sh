#!/usr/bin/env bash
# Device call 1 of session 10 (2026-12-03): issue 19's demo pair at concurrency 1, offline
# (benchmarks/demo_c1.py: chains, a 16-token tree, auto over each, with how every step part ran)
# and served (adaspec compare, the tree configurations added); the host profile of a chain-4
# and a tree step; the GPU kernel tests of session 9 that never ran on the device.
. benchmarks/device_preamble.sh call1
part 90 kernel_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_kernels_gpu.py
part 200 demo_c1 python3 benchmarks/demo_c1.py --configs off,chain4,tree,tree-s4,auto,auto-tree --rounds 2 \
    --repeat 3 --out $R/demo_c1.json
part 170 demo_compare python3 -m adaspec.cli compare \
    --configs "off,always,auto,tree=always[--num-steps 6 --topk 4 --num-draft-tokens 16],autotree=auto[--num-steps 6 --topk 4 --num-draft-tokens 16]" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/demo_compare
part 80 host_demo python3 benchmarks/host_profile.py --model demo --configs chain4,tree --steps 300 \
    --prompt-len 128 --out $R/host_demo.json
grep -E "passed|failed" $R/kernel_tests.log | tail -2; grep -E "mean" $R/demo_c1.log; tail -n 9 $R/demo_compare.log; grep -E "^(chain4|tree):" $R/host_demo.log
