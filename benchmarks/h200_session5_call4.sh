#!/usr/bin/env bash
# Device call 4 of session 5 (2026-12-02): the prefill pacer with its new floor (16 prefill tokens
# per decode token) under the offline closed loop at C = 64 and 32 against unpaced, and issue
# 27's idle server at concurrency 64 again. One tarball in $OUT, rewritten after every part.
. benchmarks/device_preamble.sh call4
part 100 closed64 python3 benchmarks/closed_loop.py --concurrency 64 --requests 320 --thresholds 0,8192 \
    --out $R/closed_loop_c64.json
part 90 closed32 python3 benchmarks/closed_loop.py --concurrency 32 --requests 160 --thresholds 0,8192 \
    --out $R/closed_loop_c32.json
part 200 idle64 python3 benchmarks/idle_cost.py --out-dir $R/idle --levels 64 --waves 5
