#!/usr/bin/env bash
# Device call 5 of session 6 (2026-12-02): the GPU tests call 4's time limit cut (it ran
# tests/gpu/test_cuda.py and the first 35 of tests/gpu/test_moe_gpu.py: 49 passed, none failed):
# the MoE models against transformers with graphs (all of them again), the TP world tests, the
# GEMV / fused-op / logprob kernel tests.
. benchmarks/device_preamble.sh call5
T="python3 -m pytest -q -rA -n 0 -p no:cacheprovider"
part 150 moe_models $T tests/gpu/test_moe_gpu.py -k matches_transformers
part 150 gpu_rest $T tests/gpu/test_tp_gpu.py tests/layers/test_linear.py tests/layers/test_fused_ops.py \
    tests/engine/test_logprob_kernel.py
