#!/usr/bin/env bash
# Device call 2 of 2026-12-02 (nvidia-h200), after tensor parallelism (issue 21) and the prefill
# pacer landed: the fast path against physics_probe (TP=1 through the new code, target within
# 2% of fast_path_closing's call 8), TP=1 through a one-rank NCCL world, the GPU tests, and a
# kernel profile of the MoE decode step at b=1 (issue 20: what eats the gap to the roofline).
# Each part has its own limit. .carry/tools = ../shared/tools, .whl = the server's wheels.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
R=/tmp/c2; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; } > $R/device.txt 2>&1
part() { local lim=$1 name=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 $lim "$@" > $R/$name.log 2>&1;
         echo "[$name rc=$? $((SECONDS-t0))s]"; tail -n 4 $R/$name.log; }
part 100 physics python3 .carry/tools/physics_probe.py --batch 1,16,64,256 --q 1,4,16 --ctx 512 --json $R/physics.json
part 190 fast_path python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --out $R/fast_path_steps.json \
    --configs off,chain3,tree16 --skip generate,throughput
part 90 tp1_world python3 benchmarks/tp_steps.py --physics $R/physics.json --out $R/tp1_world.json --configs tp1,tp1world --batches 1,64
part 150 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu
part 80 moe_profile python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics benchmarks/results/h200/moe/call1_moe_physics.json \
    --physics-key roofline_ms --batches 1 --configs off --skip generate,throughput --profile --out $R/moe_profile.json
tar czf $OUT/call2.tar.gz -C $R .
