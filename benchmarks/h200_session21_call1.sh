#!/usr/bin/env bash
# Session 21, device call 1 (issue 20): the GPU tests first (token graphs' first run on a GPU, the
# expert-parallel kernel test), then, only if they all pass, parts of the MoE load experiment in
# the call's time left (benchmarks/h200_load_parts_call.sh; same tarball).
#   bash benchmarks/h200_session21_call1.sh NAME=LABELS[@LEVELS] ...   (carry [".whl"]; kind nvidia-h200)
set -u
. benchmarks/device_preamble.sh call1
part 300 gpu_tests python3 -m pytest -n 0 -p no:cacheprovider -q tests/gpu
grep -E "passed|failed|error" $R/gpu_tests.log | tail -n 5
tail -n 1 $R/gpu_tests.log | grep -qE "failed|error" && { echo "[GPU tests failed: no load parts]"; exit 1; }
END_S=$((585 - SECONDS)) bash benchmarks/h200_load_parts_call.sh call1 qwen3-30b-a3b "$@"
