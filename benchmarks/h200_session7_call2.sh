#!/usr/bin/env bash
# Device call 2 of session 7 (2026-12-02): the fused-MoE GPU conformance tests (the chunked
# alignment now serves from 33 pairs), then part a of the MoE load experiment (issue 20 target 3):
# off, chain3, thr32 and the offline LLM.generate reference, C = 1, 16, 64, 128, 256, 3 waves.
. benchmarks/device_preamble.sh call2
part 80 kernel_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_moe_gpu.py -k kernel -x
part 500 load_a python3 benchmarks/load_experiment.py --shape qwen3-30b-a3b --out-dir /tmp/le --part a \
    --only off,chain3,thr32 --levels 1,16,64,128,256 --waves 3 --tar $OUT/load_experiment-a.tar.gz
tail -n 30 $R/load_a.log
