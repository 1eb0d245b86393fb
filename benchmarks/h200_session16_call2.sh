#!/usr/bin/env bash
# Device call 2 of session 16 (2026-12-05): issue 24's json_schema throughput target with
# simulated acceptance that replaces a dummy head's forbidden drafts by legal ones
# (structured/bitmask.py `legalize`), the device tests of that path and of FP8 checkpoints
# dequantized on the GPU. (Logprobs' cost target was met in session 6: 0.956.)
# (Call 1 was issue 19's served run, benchmarks/h200_session14_call3.sh.)
. benchmarks/device_preamble.sh call2
part 120 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_fp8_gpu.py \
    tests/gpu/test_cuda.py -k "grammar or fp8 or simulated"
part 150 structured python3 benchmarks/structured_h200.py --num-prompts 192 --json $R/structured_h200.json
grep -v Warn $R/structured.log | tail -n 12
