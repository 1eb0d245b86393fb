#!/usr/bin/env bash
# Issue 19's closing measurement on the H200, one device call (see
# benchmarks/results/h200/structure/README.md). Run from the repository root with
# .carry/tools/ = ../shared/tools/ and .whl/ = the server's wheels; $OUT receives one tarball.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; date -u; git log -1 --format=%H 2>/dev/null; } > $R/device.txt
python3 .carry/tools/physics_probe.py --batch 1,16,64,256 --q 1,4,16 --ctx 512 --json $R/physics.json > $R/physics.log 2>&1
python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --out $R/fast_path_steps.json --configs off,chain3,tree16 \
    --skip generate,throughput > $R/fast_path_steps.log 2>&1
python3 benchmarks/host_profile.py --shape llama-8b --configs off,chain3 --steps 100 --out $R/host_8b.json > $R/host_8b.log 2>&1
python3 benchmarks/host_profile.py --model demo --configs off,chain4,auto --steps 300 --prompt-len 128 --out $R/host_demo.json > $R/host_demo.log 2>&1
timeout 200 python3 -m adaspec.cli compare --configs off,always,auto --concurrency 1 --dataset tests/data/demo_heldout.jsonl \
    --output-len 64 --num-prompts 16 --num-warmup 1 --num-steps 4 --device cuda --out-dir $R/demo_compare > $R/demo_compare.log 2>&1
timeout 240 python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu > $R/gpu_tests.log 2>&1
tar czf $OUT/structure_call.tar.gz -C $R .
tail -n 5 $R/*.log
