#!/usr/bin/env bash
# The session-15 simulations of `auto` (run from the repository root): run.sh OUT_DIR LABEL.
# The session-14 suite (results/cpu/auto_sim_session14_2026-12-04/run.sh) plus MoE-shaped
# scenarios (issue 20, at batch 1: off 1.44 ms and a chain of 3 3.66 ms, the roofline of
# moe_physics_probe.py, the other chains set around it; batch 16 likewise from 9.58 / 14.11 ms)
# and a weak dense head at batch 1. Each
# line writes OUT_DIR/LABEL_NAME.json and prints a summary.
O=$1; V=$2; mkdir -p $O
T=benchmarks/results/h200/session14_2026-12-04/call2/trace.json
FLAT=0.60,0.90,0.91,0.92,0.93,0.94,0.95,0.96,0.97
TRACE=0.362,0.574,0.601,0.605,0.613,0.640,0.641,0.608,0.691
Q8=0.693,0.755,0.612,0.787,0.68,0.68,0.68,0.68
P8=0.244,0.423,0.393,0.424,0.469,0.515,0.552,0.592,0.63
run() { name=$1; shift; echo "$V $name: $(python3 benchmarks/auto_sim.py "$@" --out $O/${V}_$name.json | tail -1 | sed 's/auto \/ best fixed over //')"; }
run k8_req_d25 --costs $FLAT --cond $Q8 --noise-from $T --drift 0.25 --drift-period 300 --regime-every 40 --regime-spread 0.4 --paired --steps 2500 --seeds 30 &
run k8_req_d35 --costs $FLAT --cond $Q8 --noise-from $T --drift 0.35 --drift-period 100 --regime-every 40 --regime-spread 0.4 --paired --steps 2500 --seeds 30 &
run k8_noise_d25 --costs $FLAT --cond $Q8 --noise-from $T --drift 0.25 --drift-period 300 --steps 2500 --seeds 30 &
run k8_noise_prof --costs $FLAT --cond $Q8 --noise-from $T --drift 0.35 --drift-period 100 --profile $P8 --steps 2500 --seeds 30 &
wait
run k8_trace_spikes --costs $TRACE --cond $Q8 --noise 0.15 --drift 0.35 --drift-period 100 --spike-rate 0.02 --spike-factor 2 --profile $P8 --steps 2500 --seeds 40 &
run k4_d25 --costs 0.55,0.78,0.8,0.82,0.84 --cond 0.693,0.755,0.612,0.787 --noise 0.15 --drift 0.25 --drift-period 300 --steps 2500 --seeds 40 &
run b256_off --costs 14,26,36,46,56 --cond 0.8,0.8,0.8,0.8 --batch 256 --noise 0.05 --steps 2500 --seeds 20 &
run moe_b1 --costs 1.44,3.2,3.4,3.66,3.9 --cond 0.8,0.8,0.8,0.8 --batch 1 --noise 0.05 --paired --steps 1500 --seeds 40 &
wait
run moe_b1_req --costs 1.44,3.2,3.4,3.66,3.9 --cond 0.8,0.8,0.8,0.8 --batch 1 --noise 0.05 --paired --steps 1500 --seeds 40 --regime-every 100 --regime-spread 0.3 &
run moe_b16 --costs 9.6,13,13.6,14.1,14.6 --cond 0.8,0.8,0.8,0.8 --batch 16 --noise 0.05 --paired --steps 1500 --seeds 20 &
run moe_b1_weak --costs 1.44,3.2,3.4,3.66,3.9 --cond 0.7,0.7,0.7,0.7 --batch 1 --noise 0.05 --paired --steps 1500 --seeds 40 &
run dense_b1_weak --costs 5.3,7.0,7.3,7.6,7.9 --cond 0.6,0.6,0.6,0.6 --batch 1 --noise 0.05 --paired --steps 1500 --seeds 40 &
wait
