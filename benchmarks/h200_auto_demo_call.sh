#!/usr/bin/env bash
# The demo pair on the H200 after the start-up profile change: offline host split for auto,
# and the server compare (off, always, auto) at concurrency 1. .whl/ = the server's wheels.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/tmp/r4; mkdir -p $R
timeout 240 python3 -m adaspec.cli compare --configs off,always,auto --concurrency 1 --dataset tests/data/demo_heldout.jsonl \
    --output-len 64 --num-prompts 16 --num-warmup 1 --num-steps 4 --device cuda --out-dir $R/demo_compare > $R/demo_compare.log 2>&1
python3 benchmarks/host_profile.py --model demo --configs off,auto --steps 300 --prompt-len 128 --out $R/host_demo.json > $R/host_demo.log 2>&1
tar czf $OUT/call4.tar.gz -C $R .
grep -E "^(off|chain|auto)" $R/*.log; tail -n 12 $R/demo_compare.log
