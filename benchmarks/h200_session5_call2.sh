#!/usr/bin/env bash
# Device call 2 of session 5 (2026-12-02): the one-pass logprobs kernel (GPU tests, where a
# logprobs step's cost goes, offline cost at b = 64), the fast path with the batch built
# unpaced (decode and verify steps against physics_probe's T(b, q); the tree before tensor
# parallelism, 36ba152, as the same-call A/B; the paced build once more for the evidence), and
# issue 27's idle server at concurrency 1. One tarball in $OUT, rewritten after every part.
. benchmarks/device_preamble.sh call2
part 120 gpu_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/engine/test_logprob_kernel.py \
    tests/gpu/test_cuda.py -k "logprob or post_graph"
part 60 physics python3 .carry/tools/physics_probe.py --batch 1,16,64,256 --q 1,4,16 --ctx 512 --json $R/physics.json
part 120 fast python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --out $R/fast.json --skip generate,throughput
PYTHONPATH=/tmp/site:.carry/bis/36ba152 part 45 fast_old python3 .carry/bis/36ba152/benchmarks/gpu_fast_path.py \
    --physics $R/physics.json --out $R/fast_old.json --configs off --batches 64,256 --skip generate,throughput
part 45 fast_paced python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --out $R/fast_paced.json \
    --configs off --batches 64 --skip generate,throughput --prefill-threshold 0
part 100 lp_profile python3 benchmarks/logprobs_profile.py --out $R/logprobs_profile.json
part 150 features python3 benchmarks/sampling_features_cost.py --shape llama-8b --batch 64 --device cuda \
    --output-len 256 --repeats 2 --waves 4 --out $R/sampling_features_cost.json
part 120 idle python3 benchmarks/idle_cost.py --out-dir $R/idle --levels 1 --waves 8
