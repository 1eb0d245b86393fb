#!/usr/bin/env bash
# Device call 2 of session 14 (2026-12-04): what each draft length of the demo pair costs the
# engine's cadence at batch 1 and what switching length costs (a scripted schedule,
# benchmarks/step_cost_trace.py); then off / auto / always at 8 drafts served at concurrency 1
# (auto: probes priced by the median of their last steps against the chosen length's, decisions
# re-evaluated every 8 steps while nothing changes).
. benchmarks/device_preamble.sh call2
part 120 trace python3 benchmarks/step_cost_trace.py --num-steps 8 --out $R/trace.json
cat $R/trace.log | grep -v Warn | tail -n 12
part 200 served python3 -m adaspec.cli compare --configs "off,auto8=auto[--num-steps 8],always8=always[--num-steps 8]" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --device cuda --out-dir $R/served
grep -h "^   1 \|^-- " $R/served.log; grep -h "shutdown" $R/served/server-auto8.log | cut -c1-1500
