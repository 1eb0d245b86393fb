#!/usr/bin/env bash
# Device call 1 of session 14 (2026-12-04): how a chain step of the demo pair at batch 1 costs
# with its depth (3..8 drafts), now that the drafts' metadata is derived on the device; the
# demo pair served at concurrency 1, auto and always at 4 and 8 drafts against off, in two
# interleaved rounds (auto's probes timed against the steps before them, 749e89c, first
# measured here); lossless deep chains with graphs.
. benchmarks/device_preamble.sh call1
part 120 anatomy python3 benchmarks/launch_anatomy.py --configs off,chain3,chain4,chain6,chain8 --steps 300 \
    --out $R/anatomy.json
grep "==" $R/anatomy.log
part 370 served python3 -m adaspec.cli compare \
    --configs "off,auto4=auto[--num-steps 4],auto8=auto[--num-steps 8],always4=always[--num-steps 4],always8=always[--num-steps 8]" \
    --rounds 2 --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --device cuda --out-dir $R/served
tail -n 25 $R/served.log; grep -h "shutdown" $R/served/*/server-auto*.log $R/served/server-auto*.log 2>/dev/null | cut -c1-600
part 60 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_cuda.py -k "lossless_chain_and_tree"
tail -n 4 $R/gpu_tests.log
