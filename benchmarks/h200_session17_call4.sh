#!/usr/bin/env bash
# Device call 4 of session 17 (2026-12-05), issue 19: a single request's prompt steps replay the
# batch-1 target graphs padded to PREFILL_ROWS (engine/cuda_graph.py). The GPU tests of the graph
# paths (the new padded-prompt test among them), then the prefill profile of call 3 again.
. benchmarks/device_preamble.sh call4
part 240 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_cuda.py tests/engine/test_overlap.py \
    -k "padded or lossless_chain or overlap or no_kernel_compiles or post_graphs_equal or graphs_and_triton or grammar_with_speculation"
part 120 prefill python3 benchmarks/prefill_profile.py --configs off,chain8 --requests 40 --out $R/prefill.json
tail -n 3 $R/gpu_tests.log; grep -E "^(off|chain8):" $R/prefill.log
