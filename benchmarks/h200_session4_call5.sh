#!/usr/bin/env bash
# Device call 5 of 2026-12-02 (session 4): issue 20, the fused-MoE small-batch path (no
# alignment, top-k sum in the down kernel): its GPU conformance tests, then the whole decode
# step at b = 1 (Qwen3-30B-A3B shape) before (dispatch forced onto the aligned path: the code
# of main before the merge) and after, against the roofline probe in the same call.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p $R
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; date -u; } > $R/device.txt
part() { local lim=$1 name=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 $lim "$@" > $R/$name.log 2>&1;
         echo "[$name rc=$? $((SECONDS-t0))s]"; tail -n 4 $R/$name.log; tar czf $OUT/call5.tar.gz -C $R .; }
part 30 physics python3 .carry/tools/moe_physics_probe.py --batch 1 --q 1 --ctx 512 --json $R/moe_physics.json
FP="--shape qwen3-30b-a3b --physics $R/moe_physics.json --physics-key roofline_ms --batches 1 --configs off --skip generate,throughput"
part 60 after python3 benchmarks/gpu_fast_path.py $FP --profile --out $R/after.json
part 60 before python3 -c "import runpy,sys; import adaspec.layers.moe.triton_kernels as tk; tk.use_small_path=lambda *a: False; sys.argv=['gpu_fast_path.py']+sys.argv[1:]; runpy.run_path('benchmarks/gpu_fast_path.py', run_name='__main__')" $FP --out $R/before.json
part 60 conformance python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_moe_gpu.py -k "kernel or contract" -x
