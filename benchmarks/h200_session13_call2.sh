#!/usr/bin/env bash
# Device call 2 of session 13 (2026-12-04): chain draft graphs that load their inputs and the
# step's in-flight shift with one copy and apply the shift themselves. GPU tests of what changed;
# the host's speed from one process to the next (unpinned, and pinned to one core); the step's
# parts; the demo pair served at concurrency 1 (off / auto / always), twice.
. benchmarks/device_preamble.sh call2
part 190 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/engine/test_overlap.py \
    tests/gpu/test_cuda.py -k "chain_steps or shift or lossless_chain or overlap or no_kernel_compiles or post_graphs_equal or graphs_and_triton or grammar_with_speculation"
tail -n 4 $R/gpu_tests.log
{ lscpu; nvidia-smi topo -m; cat /sys/bus/pci/devices/*/numa_node 2>/dev/null | sort | uniq -c; \
  python3 -c "import os; print('affinity', sorted(os.sched_getaffinity(0)))"; } > $R/cpu.txt 2>&1
grep -E "Model name|^CPU\(s\)|NUMA|MHz|Thread|affinity" $R/cpu.txt; grep -A3 "GPU0" $R/cpu.txt | head -4
for i in 1 2 3; do part 40 off_free$i python3 benchmarks/launch_anatomy.py --configs off --steps 400 --out $R/off_free$i.json; done
for i in 1 2 3; do part 40 off_pin$i taskset -c 3 python3 benchmarks/launch_anatomy.py --configs off --steps 400 --out $R/off_pin$i.json; done
grep -h "^== " $R/off_free*.log $R/off_pin*.log
part 60 anatomy python3 benchmarks/launch_anatomy.py --configs off,chain4 --out $R/anatomy.json
grep -h "^== \|launch  \|_prepare\|chain\.\|Shift.apply\|graph\.\|CUDAGraph.replay" $R/anatomy.log
for i in 1 2; do
  part 170 served$i python3 -m adaspec.cli compare --configs "off,auto,always" \
      --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
      --num-steps 4 --device cuda --out-dir $R/served$i
  tail -n 5 $R/served$i.log; grep -h "shutdown" $R/served$i/server-*.log | cut -c1-500
done
