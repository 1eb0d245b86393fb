#!/usr/bin/env bash
# Device call 5 of session 5 (2026-12-02): issue 27's idle server at concurrency 256 (2 waves),
# the level the earlier calls did not reach. One tarball in $OUT.
. benchmarks/device_preamble.sh call5
part 200 idle256 python3 benchmarks/idle_cost.py --out-dir $R/idle --levels 256 --waves 2
