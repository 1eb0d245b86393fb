#!/usr/bin/env bash
# Device call 2 of session 10 (2026-12-03): issue 19 after call 1 found auto at batch 1 held
# off by its own catch-up debts (prompts refreshed no draft while it said 0, so each new
# request owed a whole-prompt catch-up, priced per row from eager steps; probes from off
# always ran depth 1). The demo pair offline and served at concurrency 1, chains of 4 and 6.
. benchmarks/device_preamble.sh call2
part 130 demo_c1 python3 benchmarks/demo_c1.py --configs off,chain4,chain6,auto,auto6 --rounds 2 \
    --repeat 3 --out $R/demo_c1.json
part 280 demo_compare python3 -m adaspec.cli compare \
    --configs "off,chain4=always[--num-steps 4],auto4=auto[--num-steps 4],always,auto" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 6 --device cuda --out-dir $R/demo_compare
grep -E "mean" $R/demo_c1.log; tail -n 9 $R/demo_compare.log
