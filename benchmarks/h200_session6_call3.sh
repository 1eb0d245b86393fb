#!/usr/bin/env bash
# Device call 3 of session 6 (2026-12-02): the few-rows GEMV (layers/linear.py) and the q/k head
# norms fused into the rotary kernel. The GEMV against cuBLAS; the GPU kernel tests; the MoE
# decode step at b = 1 against the roofline, this tree and a6a5936 (before both) in the same call;
# the dense fast path at b = 1 and 64 against physics_probe; logprobs / penalties offline
# (logprob entries as tuples); MoE offline throughput (LLM unpaced by default).
# .carry/bis/a6a5936: `git archive a6a5936 adaspec benchmarks/gpu_fast_path.py` (demo weights left out).
. benchmarks/device_preamble.sh call3
part 120 gemv python3 benchmarks/kernels/gemv_sweep.py --json $R/gemv_sweep.json
part 90 kernel_tests python3 -m pytest -q -n 0 -p no:cacheprovider tests/layers/test_linear.py tests/layers/test_fused_ops.py
part 40 moe_physics python3 .carry/tools/moe_physics_probe.py --batch 1,256 --q 1,4 --ctx 512 --json $R/moe_physics.json
part 100 moe_new python3 benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics $R/moe_physics.json \
    --physics-key roofline_ms --batches 1 --configs off,chain3 --skip generate,throughput --out $R/moe_new.json
dir=.carry/bis/a6a5936
PYTHONPATH=/tmp/site:$dir part 80 moe_old python3 $dir/benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b \
    --physics $R/moe_physics.json --physics-key roofline_ms --batches 1 --configs off --skip generate,throughput \
    --out $R/moe_old.json
part 60 physics python3 .carry/tools/physics_probe.py --batch 1,64 --q 1,4 --ctx 512 --json $R/physics.json
part 90 dense_new python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --batches 1,64 --configs off,chain3 \
    --skip generate,throughput --out $R/dense_new.json
part 150 features python3 benchmarks/sampling_features_cost.py --shape llama-8b --batch 64 --device cuda \
    --output-len 256 --repeats 3 --waves 4 --out $R/sampling_features_cost.json
part 100 moe_offline python3 benchmarks/moe_offline.py --skip-hf --physics $R/moe_physics.json --out $R/moe_offline.json
