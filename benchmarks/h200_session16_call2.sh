#!/usr/bin/env bash
# Device call planned in session 16 (2026-12-05; no device was lent that session, so not run yet):
# issue 24's json_schema throughput target with simulated acceptance that replaces a dummy head's
# forbidden drafts by legal ones (structured/bitmask.py `legalize`), the device tests of that path
# and of FP8 checkpoints dequantized on the GPU, and the logprobs cost in the same call.
# (Issue 19's served run is benchmarks/h200_session14_call3.sh: run it as call 1.)
. benchmarks/device_preamble.sh call2
part 120 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_fp8_gpu.py \
    tests/gpu/test_cuda.py -k "grammar or fp8 or simulated"
part 300 structured python3 benchmarks/structured_h200.py --num-prompts 192 --json $R/structured_h200.json
grep -v Warn $R/structured.log | tail -n 12
part 150 logprobs python3 benchmarks/logprobs_profile.py --out $R/logprobs_profile.json
grep -v Warn $R/logprobs.log | tail -n 8
