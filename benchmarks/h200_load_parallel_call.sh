#!/usr/bin/env bash
# Issue 20's target 3 (the load experiment, 8 waves per level: C = 1..256; off, chain3, tree16,
# threshold:32, auto; simulated acceptance 0.8) with the parts side by side, one GPU each
# (benchmarks/parallel_parts.py), so a whole shape fits one device call:
#   nvidia-h200-x4:  bash benchmarks/h200_load_parallel_call.sh moe      (then: dense, a second call)
#   nvidia-h200-x8:  bash benchmarks/h200_load_parallel_call.sh both     (MoE on GPUs 0-3, dense on 4-7)
# Estimated (load_experiment.py --dry-run, H200): the longest part 389 s (MoE `off` + its
# LLM.generate reference) and 411 s (dense tree16 at 256, then thr32). Then, here:
#   python3 benchmarks/flip_plot.py --dense DENSE/compare.json --moe MOE/compare.json --out flip.png
# Run from the repository root with .whl/ = the server's wheels (carry [".whl"]).
set -u
WHICH=${1:-both}
. benchmarks/device_preamble.sh load_${WHICH}
COMMON="--waves 8 --accept-rate 0.8 --server-timeout 240"
run_shape() {  # $1 shape label, $2 GPUs, $3 groups, $4 load_experiment shape
    timeout --kill-after=10 570 python3 benchmarks/parallel_parts.py --out-dir $R/$1 --gpus $2 --groups "$3" \
        -- --shape $4 $COMMON > $R/$1.log 2>&1
    echo "[$1 rc=$?]"; tail -n 25 $R/$1.log
}
MOE_GROUPS="off;chain3,auto;tree16;thr32"
DENSE_GROUPS="off;chain3,auto;tree16@1,2,4,8,16,32,64,128;tree16@256;thr32"
case "$WHICH" in
    moe)   run_shape moe 0,1,2,3 "$MOE_GROUPS" qwen3-30b-a3b ;;
    dense) run_shape dense 0,1,2,3,3 "$DENSE_GROUPS" llama-8b ;;
    both)  run_shape moe 0,1,2,3 "$MOE_GROUPS" qwen3-30b-a3b &
           run_shape dense 4,5,6,7,7 "$DENSE_GROUPS" llama-8b &
           wait ;;
esac
tar czf $OUT/load_${WHICH}.tar.gz -C $R .
