#!/usr/bin/env bash
# Re-records benchmarks/cpu_example/compare.{json,png}: `adaspec compare` of the four
# speculation policies on a tiny random Llama (CPU), with a SIMULATED acceptance rate of 0.7
# (a random draft head accepts almost nothing, so the simulation stands in for a trained one).
# Takes a few minutes on 2 CPU cores. The tiny model goes to benchmarks/tmp/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m adaspec.testing benchmarks/tmp/demo
python -m adaspec.cli compare \
  --model benchmarks/tmp/demo/target --draft benchmarks/tmp/demo/draft \
  --configs off,always,threshold:4,auto \
  --device cpu --dtype float32 --spec-simulate-accept-rate 0.7 --num-steps 3 --topk 1 \
  --dataset random --input-len 64 --output-len 64 \
  --concurrency 1,2,4,8,16 --num-prompts 48 --num-warmup 2 --seed 0 \
  --out-dir benchmarks/cpu_example --disable-tqdm
# The server logs are only useful when something fails; keep the recorded example small.
rm -f benchmarks/cpu_example/server-*.log
