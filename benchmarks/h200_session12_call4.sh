#!/usr/bin/env bash
# Device call 4 of session 12 (2026-12-04): issue 19, after the host cuts (PDL chosen per model:
# off for the demo pair; step marks reused; the in-flight shift in one launch). The step's parts
# A/B against the session's base tree (f5a76d6, carried in .carry/base), interleaved; the GPU
# tests of what changed; the demo pair served at concurrency 1 (off / auto / always).
. benchmarks/device_preamble.sh call4
ln -sfn $PWD/adaspec/demo/target .carry/base/adaspec/demo/target
ln -sfn $PWD/adaspec/demo/head .carry/base/adaspec/demo/head
for i in 1 2; do
  PYTHONPATH=/tmp/site:$PWD/.carry/base part 60 anatomy_base$i python3 benchmarks/launch_anatomy.py --configs off,chain4 --out $R/anatomy_base$i.json
  part 60 anatomy_new$i python3 benchmarks/launch_anatomy.py --configs off,chain4 --out $R/anatomy_new$i.json
done
grep -h "^== \|launch  \|_prepare\|Shift.apply\|marks\|_timer\|CUDAGraph.replay" $R/anatomy_*.log
part 170 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/layers/test_pdl.py tests/gpu/test_kernels_gpu.py \
    tests/engine/test_overlap.py tests/gpu/test_cuda.py -k "pdl or shift or lossless_chain or overlap or no_kernel_compiles or post_graphs_equal or graphs_and_triton"
tail -n 5 $R/gpu_tests.log
part 170 served python3 -m adaspec.cli compare --configs "off,auto,always" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/served
tail -n 9 $R/served.log; grep -h "shutdown" $R/served/server-*.log | cut -c1-600
