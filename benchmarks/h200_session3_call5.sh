#!/usr/bin/env bash
# Device call 5 of 2026-12-02: after structured outputs (issue 24b) landed: the CUDA grammar
# and logprobs/penalties tests, the cost of a json_schema grammar on every request at
# concurrency 64 (8B shape), and the demo pair compare at C = 1 (off, always, auto).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT; date -u > $R/date.txt   # straight into $OUT: a call cut short still returns what finished
part() { local lim=$1 name=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 $lim "$@" > $R/$name.log 2>&1;
         echo "[$name rc=$? $((SECONDS-t0))s]"; tail -n 8 $R/$name.log; }
part 55 gpu_grammar python3 -m pytest -q -n 0 -p no:cacheprovider -rf tests/gpu/test_cuda.py -k "grammar or logprobs_penalties"
part 75 structured python3 benchmarks/structured_h200.py --num-prompts 128 --json $R/structured_h200.json
part 90 demo_compare python3 -m adaspec.cli compare --configs off,always,auto --concurrency 1 \
    --dataset tests/data/demo_heldout.jsonl --output-len 64 --num-prompts 16 --num-warmup 1 --num-steps 4 \
    --device cuda --out-dir /tmp/demo_compare
cp /tmp/demo_compare/compare.json $R/demo_compare.json
