#!/usr/bin/env bash
# Device call 1 of session 13 (2026-12-04): chain drafts with device-derived metadata.
# GPU tests (the kernel against its PyTorch ops; lossless chains and trees, graphs, overlap, no
# compiles while serving), the step's parts against the session's base (620acef, in .carry/base)
# interleaved, then the demo pair served at concurrency 1 (off / auto / always), twice.
. benchmarks/device_preamble.sh call1
ln -sfn $PWD/adaspec/demo/target .carry/base/adaspec/demo/target
ln -sfn $PWD/adaspec/demo/head .carry/base/adaspec/demo/head
part 190 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/engine/test_overlap.py \
    tests/gpu/test_cuda.py -k "chain_steps or shift or lossless_chain or overlap or no_kernel_compiles or post_graphs_equal or graphs_and_triton or grammar_with_speculation"
tail -n 4 $R/gpu_tests.log
for i in 1; do
  PYTHONPATH=/tmp/site:$PWD/.carry/base part 60 anatomy_base$i python3 benchmarks/launch_anatomy.py --configs off,chain4 --out $R/anatomy_base$i.json
  part 60 anatomy_new$i python3 benchmarks/launch_anatomy.py --configs off,chain4 --out $R/anatomy_new$i.json
done
for f in base1 new1; do echo "## $f"; grep -h "^== \|launch  \|_prepare\|chain\.\|Shift.apply\|graph\.\|CUDAGraph.replay" $R/anatomy_$f.log; done
for i in 1 2; do
  part 170 served$i python3 -m adaspec.cli compare --configs "off,auto,always" \
      --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
      --num-steps 4 --device cuda --out-dir $R/served$i
  tail -n 9 $R/served$i.log; grep -h "shutdown" $R/served$i/server-*.log | cut -c1-900
done
