#!/usr/bin/env bash
# Device call 3 of session 13 (2026-12-04): the demo pair served at concurrency 1 after auto's
# probe runs (off / auto / always); the dense 8B fast path against physics_probe (chain steps now
# derive their metadata and apply the in-flight shift inside the draft graph); GPU tests.
. benchmarks/device_preamble.sh call3
part 170 served python3 -m adaspec.cli compare --configs "off,auto,always" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/served
tail -n 5 $R/served.log; grep -h "shutdown" $R/served/server-auto.log | cut -c1-700
part 30 physics python3 .carry/tools/physics_probe.py --batch 1,16,64 --q 1,4 --ctx 512 --json $R/physics.json
part 110 dense python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --configs off,chain3 --batches 1,16,64 \
    --skip generate,throughput --out $R/dense.json
tail -n 14 $R/dense.log
part 150 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_cuda.py \
    -k "chain_steps or lossless_chain or overlap or no_kernel_compiles or post_graphs_equal or graphs_and_triton"
tail -n 4 $R/gpu_tests.log
