#!/usr/bin/env bash
# Issue 22 on two H200s (nvidia-h200-x2), one device call per part:
#   bash benchmarks/h200x2_tp_call.sh steps   # decode steps TP=1 vs TP=2 vs physics_probe, chain 3 at
#                                             # TP=2, NCCL profile, the MoE shape (experts cut and expert
#                                             # parallel), GPU tests (TP=2 == TP=1)
#   bash benchmarks/h200x2_tp_call.sh load-a  # the load experiment at TP=2 (C = 1..256): off, chain3, thr32, idle
#   bash benchmarks/h200x2_tp_call.sh load-b  # ... tree16, auto
# then, here: python3 benchmarks/load_experiment.py --tensor-parallel-size 2 --merge load_experiment_tp2-a.tar.gz load_experiment_tp2-b.tar.gz
# Run from the repository root with .carry/tools/ = ../shared/tools/ and .whl/ = the server's
# wheels; $OUT receives one tarball per part. NVLink multicast stays off in every process.
set -u
PART=${1:-steps}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
R=/tmp/r; mkdir -p $R
{ nvidia-smi -L; nvidia-smi topo -m; nvidia-smi --query-gpu=driver_version --format=csv,noheader; date -u;
  git log -1 --format=%H 2>/dev/null; } > $R/device.txt
if [ "$PART" = steps ]; then
    python3 .carry/tools/physics_probe.py --batch 1,16,64,256 --q 1,4 --ctx 512 --json $R/physics.json > $R/physics.log 2>&1
    python3 benchmarks/tp_steps.py --physics $R/physics.json --out $R/tp_steps.json --profile > $R/tp_steps.log 2>&1
    python3 .carry/tools/moe_physics_probe.py --json $R/moe_physics.json > $R/moe_physics.log 2>&1
    python3 benchmarks/tp_steps.py --shape qwen3-30b-a3b --physics $R/moe_physics.json --physics-key roofline_ms \
        --batches 1,16,256 --configs tp1,tp2,tp2ep --out $R/tp_steps_moe.json > $R/tp_steps_moe.log 2>&1
    timeout 400 python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu > $R/gpu_tests.log 2>&1
    # A rank's expert shape at TP=2 has no measured launch table: sweep it (merge by hand into
    # adaspec/layers/moe/moe_configs.json, then time tp2 again).
    (cd benchmarks/kernels && timeout 200 python3 moe_sweep.py --shape qwen3-30b-a3b-tp2 --budget-s 150 \
        --json $R/moe_sweep_tp2.json --configs-out $R/moe_configs_tp2.json) > $R/moe_sweep_tp2.log 2>&1
else
    case "$PART" in load-a) ONLY=off,chain3,thr32,idle ;; *) ONLY=tree16,auto ;; esac
    timeout 560 python3 benchmarks/load_experiment.py --tensor-parallel-size 2 --out-dir $R/load_experiment_tp2 \
        --part "${PART#load-}" --only $ONLY --tar $OUT/load_experiment_tp2-${PART#load-}.tar.gz \
        > $R/load_experiment.log 2>&1
fi
tar czf $OUT/tp2_$PART.tar.gz -C $R .
tail -n 5 $R/*.log
