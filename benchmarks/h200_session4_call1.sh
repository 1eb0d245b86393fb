#!/usr/bin/env bash
# Device call 1 of 2026-12-02 (session 4): issue 24 after the post graphs gained their extras
# (logprobs of every row; a grammar's bitmask) and grammar steps are planned ahead: the GPU
# tests (all of tests/gpu), a json_schema grammar on every request at concurrency 64, and the
# cost of logprobs / penalties at b = 64 (8B shape, dummy weights, simulated acceptance).
# Run from the repository root with .carry/tools/ = ../shared/tools/ and .whl/ = the wheels.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT; { nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; date -u; } > $R/device.txt
part() { local lim=$1 name=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 $lim "$@" > $R/$name.log 2>&1;
         echo "[$name rc=$? $((SECONDS-t0))s]"; tail -n 6 $R/$name.log; }
part 110 structured python3 benchmarks/structured_h200.py --num-prompts 192 --json $R/structured_h200.json
part 150 features python3 benchmarks/sampling_features_cost.py --shape llama-8b --batch 64 --device cuda \
    --output-len 256 --repeats 3 --out $R/sampling_features_cost.json
part 300 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider -rf tests/gpu
