#!/usr/bin/env bash
# Device call 6 of session 12 (2026-12-04): the demo pair served at concurrency 1 after auto's
# freshness-aware cost floor (off / auto / always).
. benchmarks/device_preamble.sh call6
part 170 served python3 -m adaspec.cli compare --configs "off,auto,always" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/served
tail -n 9 $R/served.log; grep -h "shutdown" $R/served/server-*.log | cut -c1-1600
