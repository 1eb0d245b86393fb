#!/usr/bin/env bash
# Device call 3 of session 5 (2026-12-02): logprobs with the Triton logsumexp (GPU tests, profile,
# offline cost at b = 64); the prefill pacer under an offline closed loop (C = 64 and 16: paced,
# unpaced, a fixed 1024-token cap); issue 27's idle server at concurrency 64. One tarball in
# $OUT, rewritten after every part.
. benchmarks/device_preamble.sh call3
part 120 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/engine/test_logprob_kernel.py \
    tests/gpu/test_cuda.py -k "logprob or post_graph"
part 100 lp_profile python3 benchmarks/logprobs_profile.py --out $R/logprobs_profile.json
part 150 features python3 benchmarks/sampling_features_cost.py --shape llama-8b --batch 64 --device cuda \
    --output-len 256 --repeats 2 --waves 4 --out $R/sampling_features_cost.json
part 150 closed64 python3 benchmarks/closed_loop.py --concurrency 64 --requests 320 --thresholds 0,8192,1024 \
    --out $R/closed_loop_c64.json
part 90 closed16 python3 benchmarks/closed_loop.py --concurrency 16 --requests 96 --thresholds 0,8192 \
    --out $R/closed_loop_c16.json
part 200 idle64 python3 benchmarks/idle_cost.py --out-dir $R/idle --levels 64 --waves 5
