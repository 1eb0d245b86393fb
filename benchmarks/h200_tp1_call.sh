#!/usr/bin/env bash
# Issue 21's single-H200 check, one device call (nvidia-h200): TP=1 through the new code keeps
# the fast-path figures of benchmarks/results/h200/fast_path_closing/ (call 8's row: step /
# T(b, q) within 2%), and a TP=1 NCCL world of one rank runs (its sharded layers and
# collectives captured in the CUDA graphs) at about the plain path's step time.
# Run from the repository root with .carry/tools/ = ../shared/tools/ and .whl/ = the server's
# wheels; $OUT receives one tarball.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
R=/tmp/r; mkdir -p $R
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; date -u; git log -1 --format=%H 2>/dev/null; } > $R/device.txt
python3 .carry/tools/physics_probe.py --batch 1,16,64,256 --q 1,4,16 --ctx 512 --json $R/physics.json > $R/physics.log 2>&1
python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --out $R/fast_path_steps.json --configs off,chain3,tree16 \
    --skip generate,throughput > $R/fast_path_steps.log 2>&1
python3 benchmarks/tp_steps.py --physics $R/physics.json --out $R/tp1_world.json --configs tp1,tp1world > $R/tp1_world.log 2>&1
timeout 300 python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu > $R/gpu_tests.log 2>&1
tar czf $OUT/tp1_call.tar.gz -C $R .
tail -n 5 $R/*.log
