#!/usr/bin/env bash
# Device call 4 of 2026-12-02: call 3 again for the parts that failed there (the image lacked httpx-sse):
# the idle-draft cost at C = 1 and 64, and the demo pair compare at C = 1.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/tmp/c4; mkdir -p $R; date -u > $R/date.txt
part() { local lim=$1 name=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 $lim "$@" > $R/$name.log 2>&1;
         echo "[$name rc=$? $((SECONDS-t0))s]"; tail -n 12 $R/$name.log; }
part 230 idle python3 benchmarks/idle_cost.py --out-dir $R/idle --levels 1,64 --waves 5
part 80 demo_compare python3 -m adaspec.cli compare --configs off,always,auto --concurrency 1 \
    --dataset tests/data/demo_heldout.jsonl --output-len 64 --num-prompts 32 --num-warmup 2 --num-steps 4 \
    --device cuda --out-dir $R/demo_compare
tar czf $OUT/call4.tar.gz -C $R .
