#!/usr/bin/env bash
# MoE on one H200 in one call (at most 9.3 minutes of limits; each part has its own time limit, so a failing
# part cannot eat the others' time). Run from the repository root, on the device:
#
#   bash benchmarks/moe_h200.sh          # writes everything under $OUT (default benchmarks/tmp/moe)
#
# Needs moe_physics_probe.py at .carry/moe_physics_probe.py (copied from ../shared/tools by
# the caller: ../shared does not travel to the device). Parts, in order:
#   1. GPU conformance of the fused-MoE kernel vs the torch reference (fp32 + bf16, graphs)  ~1.5 min
#   2. launch-parameter sweep per batch bucket, both MoE paths -> moe_sweep.json, moe_configs.json ~3 min
#   3. moe_physics_probe.py: torch grouped-GEMM reference and the roofline                   ~1.5 min
#   4. gpu_fast_path.py --shape qwen3-30b-a3b: decode (off) and verify (chain3) engine steps
#      at b = 1, 16, 64, 256 with dummy weights, against the probe's roofline, using the
#      sweep's launch table                                                                  ~3 min
#   5. tiny Qwen3-MoE and GLM-4.5 models on the GPU (graphs on, speculation off/on) equal to
#      transformers                                                                        ~1 min
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/tmp/moe}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
PROBE=${PROBE:-.carry/moe_physics_probe.py}
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/moe_h200.log"; }
run() {  # run LIMIT_S NAME CMD...: output to $OUT/NAME.log, status to moe_h200.log
    local limit=$1 name=$2; shift 2
    log "start $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    log "end $name rc=$rc in $((SECONDS - t0))s"
    tail -n 5 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$OUT/moe_h200.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; git rev-parse HEAD; } \
    >"$OUT/device.txt" 2>&1

run 80 conformance $PY -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_moe_gpu.py -k "kernel" -x

run 120 sweep $PY benchmarks/kernels/moe_sweep.py --json "$OUT/moe_sweep.json" \
    --configs-out "$OUT/moe_configs.json" --budget-s 95
if [ -s "$OUT/moe_configs.json" ]; then   # the engine's kernel reads its launch table from here
    cp "$OUT/moe_configs.json" adaspec/layers/moe/moe_configs.json
    log "using the sweep's launch table"
fi

if [ -f "$PROBE" ]; then
    run 110 physics $PY "$PROBE" --batch 1,16,64,256 --q 1,4 --ctx 512 --json "$OUT/moe_physics.json"
else
    log "no $PROBE: skipping the probe (and the ratios of part 4)"
fi

if [ -s "$OUT/moe_physics.json" ]; then
    run 170 fast_path $PY benchmarks/gpu_fast_path.py --shape qwen3-30b-a3b --physics "$OUT/moe_physics.json" \
        --physics-key roofline_ms --batches 1,16,64,256 --configs off,chain3 --skip generate,throughput \
        --out "$OUT/gpu_fast_path_moe.json"
fi

run 80 model_gpu $PY -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_moe_gpu.py -k "model and (qwen3_moe or glm4_moe)" -x
log "done; results in $OUT"
