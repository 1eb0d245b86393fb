#!/usr/bin/env bash
# Device call 4 of session 10 (2026-12-03): issue 19 after the server's stats snapshot stopped
# being rebuilt and sent with every step (call 3: auto's steps ~0.4 ms dearer served than
# always's at the same depth, not offline). The demo pair served at concurrency 1.
. benchmarks/device_preamble.sh call4
part 190 demo_compare python3 -m adaspec.cli compare \
    --configs "off,auto,autodefault=auto[--num-steps 3],always" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/demo_compare
tail -n 10 $R/demo_compare.log; grep -h "shutdown" $R/demo_compare/server-auto*.log | cut -c1-330
