#!/usr/bin/env bash
# Device call 5 of session 17 (2026-12-05): issue 19's target as the issue states it, the bundled
# demo pair served as `adaspec serve` serves it with no arguments (auto, up to 8 drafts) against
# off and always at concurrency 1 on the held-out Python prompts, three interleaved rounds (fresh
# servers each; the host's speed moves by up to 1.7x between processes, calls 2-3), after the
# padded prompt graphs of call 4. Each server writes its policy's feed (ADASPEC_POLICY_TRACE).
. benchmarks/device_preamble.sh call5
export ADASPEC_POLICY_TRACE=$R/served/policy
part 450 served python3 -m adaspec.cli compare --configs "off,auto,always" --rounds 3 \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 64 --num-warmup 2 \
    --device cuda --out-dir $R/served
grep -h "^   1 \|^-- \|round\|median\|ratio" $R/served.log | head -40
grep -h "shutdown" $R/served/server-auto*.log | cut -c1-300
