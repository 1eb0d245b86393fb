#!/usr/bin/env bash
# Device call 3 of 2026-12-02 (nvidia-h200), after issue 27 (no refresh while not speculating)
# and issue 24a (logprobs, penalties) landed: the GPU tests, the idle-draft cost (idle vs two
# plain servers, C = 1 and 64), what logprobs and penalties cost at b = 64, and the demo pair's
# compare (off, always, auto) at C = 1. Each part has its own limit.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
R=/tmp/c3; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; } > $R/device.txt 2>&1
part() { local lim=$1 name=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 $lim "$@" > $R/$name.log 2>&1;
         echo "[$name rc=$? $((SECONDS-t0))s]"; tail -n 6 $R/$name.log; }
part 225 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider -rf --durations=8 tests/gpu
part 190 idle python3 benchmarks/idle_cost.py --out-dir $R/idle --levels 1,64 --waves 5
part 65 sampling_cost python3 benchmarks/sampling_features_cost.py --shape llama-8b --batch 64 --device cuda \
    --out $R/sampling_features_cost.json
part 75 demo_compare python3 -m adaspec.cli compare --configs off,always,auto --concurrency 1 \
    --dataset tests/data/demo_heldout.jsonl --output-len 64 --num-prompts 32 --num-warmup 2 --num-steps 4 \
    --device cuda --out-dir $R/demo_compare
tar czf $OUT/call3.tar.gz -C $R .
