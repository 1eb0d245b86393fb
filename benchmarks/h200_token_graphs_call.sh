#!/usr/bin/env bash
# Token graphs on the H200 (issue 20; adaspec/engine/cuda_graph.py), one device call:
#   1. the GPU tests (real CUDA graphs: token graphs equal eager steps, MoE targets with graphs
#      equal transformers, no kernel compiled while serving);
#   2. a prompt step of 512 tokens on the Qwen3-30B-A3B shape, one request at a time, with token
#      graphs against eager (`-eager`), and chain 3; the JSON says how far the token graphs went
#      (`token_graph_rows`) and what capture took;
#   3. the same on the dense 8B shape (where large steps are bound by the device, capture should
#      stop below 8,192 rows).
#   bash benchmarks/h200_token_graphs_call.sh CALLN      (carry [".whl"]; kind nvidia-h200, needs_h200:
#   the MoE shape is 61 GB)
set -u
. benchmarks/device_preamble.sh $1
part 240 gpu_tests python3 -m pytest -n 0 -p no:cacheprovider -q tests/gpu
part 200 prefill_moe python3 benchmarks/prefill_profile.py --shape qwen3-30b-a3b --prompt-len 512 --requests 8 \
    --configs off,off-eager,chain3 --out $R/prefill_moe.json
grep -E "prefill step" $R/prefill_moe.log
part 120 prefill_dense python3 benchmarks/prefill_profile.py --shape llama-8b --prompt-len 512 --requests 8 \
    --configs off,off-eager --out $R/prefill_dense.json
grep -E "prefill step" $R/prefill_dense.log
