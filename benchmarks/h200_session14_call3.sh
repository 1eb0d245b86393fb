#!/usr/bin/env bash
# Device call 3 of session 14 (2026-12-04): issue 19's target as the issue states it, the
# bundled demo pair served as `adaspec serve` serves it with no arguments (auto, now up to 8
# drafts: adaspec/demo DEMO_NUM_STEPS) against off and always, at concurrency 1 on the held-out
# Python prompts, three interleaved rounds of fresh servers (the host's speed moves between
# processes), 192 requests each (8-10 s of serving, where 48 gave 2-3 s); then the cost per
# length again (benchmarks/step_cost_trace.py, the whole set). Every server writes what its policy
# observed, step by step (ADASPEC_POLICY_TRACE), for benchmarks/auto_sim.py --noise-from.
. benchmarks/device_preamble.sh call3
export ADASPEC_POLICY_TRACE=$R/served/policy   # each server's policy feed (spec_decode/policy_trace.py)
part 450 served python3 -m adaspec.cli compare --configs "off,auto,always" --rounds 3 \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 192 --num-warmup 2 \
    --device cuda --out-dir $R/served
grep -h "^   1 \|^-- \|round\|median" $R/served.log | head -40
grep -h "shutdown" $R/served/server-auto*.log | cut -c1-420
part 50 trace python3 benchmarks/step_cost_trace.py --num-steps 8 --out $R/trace.json
grep -v Warn $R/trace.log | tail -n 10
