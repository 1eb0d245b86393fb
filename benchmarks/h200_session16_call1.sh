#!/usr/bin/env bash
# Device call 1 of session 16 (2026-12-05): issue 19's target as the issue states it, the bundled
# demo pair served as `adaspec serve` serves it with no arguments (auto, up to 8 drafts) against
# off and always at concurrency 1 on the held-out Python prompts: benchmarks/h200_session14_call3.sh
# cut to two interleaved rounds (fresh servers each) and no cost trace, to fit the device time the
# session had left. Each server writes its policy's feed (ADASPEC_POLICY_TRACE).
. benchmarks/device_preamble.sh call1
export ADASPEC_POLICY_TRACE=$R/served/policy
part 330 served python3 -m adaspec.cli compare --configs "off,auto,always" --rounds 2 \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 192 --num-warmup 2 \
    --device cuda --out-dir $R/served
grep -h "^   1 \|^-- \|round\|median" $R/served.log | head -40
grep -h "shutdown" $R/served/server-auto*.log | cut -c1-420
