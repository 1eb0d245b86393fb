#!/usr/bin/env bash
# The session-14 simulations of `auto` (run from the repository root): run.sh OUT_DIR LABEL.
# LABEL names the policy in adaspec/spec_decode/auto_policy.py at the time (base = 13f80a5's,
# final = the one that landed); each line writes OUT_DIR/LABEL_NAME.json and prints a summary.
O=$1; V=$2
T=benchmarks/results/h200/session14_2026-12-04/call2/trace.json
FLAT=0.60,0.90,0.91,0.92,0.93,0.94,0.95,0.96,0.97        # off, then 1..8 drafts: host-bound, about flat
TRACE=0.362,0.574,0.601,0.605,0.613,0.640,0.641,0.608,0.691   # call 2's medians (steps 4+ of a run)
Q8=0.693,0.755,0.612,0.787,0.68,0.68,0.68,0.68           # the demo pair's conditional acceptance
P8=0.244,0.423,0.393,0.424,0.469,0.515,0.552,0.592,0.63  # the H200 start-up profile's figures
run() { name=$1; shift; echo "$V $name: $(python3 benchmarks/auto_sim.py "$@" --out $O/${V}_$name.json | tail -1)"; }
run k8_requests_drift0.25_p300 --costs $FLAT --cond $Q8 --noise-from $T --drift 0.25 --drift-period 300 \
    --regime-every 40 --regime-spread 0.4 --paired --steps 2500 --seeds 30
run k8_requests_drift0.35_p100 --costs $FLAT --cond $Q8 --noise-from $T --drift 0.35 --drift-period 100 \
    --regime-every 40 --regime-spread 0.4 --paired --steps 2500 --seeds 30
run k8_measured_noise_drift0.25_p300 --costs $FLAT --cond $Q8 --noise-from $T --drift 0.25 --drift-period 300 --steps 2500 --seeds 30
run k8_measured_noise_profile --costs $FLAT --cond $Q8 --noise-from $T --drift 0.35 --drift-period 100 --profile $P8 --steps 2500 --seeds 30
run k8_trace_costs_spikes_profile --costs $TRACE --cond $Q8 --noise 0.15 --drift 0.35 --drift-period 100 \
    --spike-rate 0.02 --spike-factor 2 --profile $P8 --steps 2500 --seeds 40
run k4_drift0.25_p300 --costs 0.55,0.78,0.8,0.82,0.84 --cond 0.693,0.755,0.612,0.787 --noise 0.15 --drift 0.25 --drift-period 300 --steps 2500 --seeds 40
run k4_drift0.35_p100 --costs 0.55,0.78,0.8,0.82,0.84 --cond 0.693,0.755,0.612,0.787 --noise 0.15 --drift 0.35 --drift-period 100 --steps 2500 --seeds 40
run b256_off_best --costs 14,26,36,46,56 --cond 0.8,0.8,0.8,0.8 --batch 256 --noise 0.05 --steps 2500 --seeds 20
