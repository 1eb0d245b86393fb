#!/usr/bin/env bash
# The session-17 simulations of `auto` (run from the repository root): run.sh OUT_DIR LABEL [POLICY FLAGS].
# `base` = `--quantile 0 --table-tolerance 0` (a window's fastest step, every change in the table:
# the policy before this session's change); `final` = no flags (the 20th percentile, 0.5% tolerance).
# demo_c1_*: the demo pair served at concurrency 1 in session 17's call 5 (H200): costs flat over
# lengths 1-8, the conditional acceptance measured by `always` (8 drafts), each request's acceptance
# x U(0.6, 1.4), noise drawn from each of four served feeds (three `always`, one `auto`). Then the
# session-15 suite's scenarios with more seeds (results/cpu/auto_sim_session15_2026-12-04/run.sh
# has their meaning). Each line writes OUT_DIR/LABEL_NAME.json and prints a summary.
O=$1; V=$2; shift 2; F="$*"; mkdir -p $O
S=benchmarks/results/h200/session17_2026-12-05/call5/served
T=benchmarks/results/h200/session14_2026-12-04/call2/trace.json
FLAT=0.60,0.90,0.91,0.92,0.93,0.94,0.95,0.96,0.97
Q8=0.693,0.755,0.612,0.787,0.68,0.68,0.68,0.68
C5=0.667,0.738,0.577,0.872,0.747,0.766,0.907,0.744
run() { name=$1; shift; echo "$V $name: $(python3 benchmarks/auto_sim.py "$@" $F --out $O/${V}_$name.json | tail -1 | sed 's/auto \/ best fixed over //' | cut -c1-40)"; }
for feed in 1435 1827 2213 1309; do
  run demo_c1_$feed --costs 0.70,1.08,1.09,1.09,1.10,1.10,1.11,1.11,1.12 --cond $C5 --noise-from $S/policy.$feed.jsonl \
      --regime-every 40 --regime-spread 0.4 --paired --steps 2800 --seeds 40 &
done
wait
run k8_req_d25 --costs $FLAT --cond $Q8 --noise-from $T --drift 0.25 --drift-period 300 --regime-every 40 --regime-spread 0.4 --paired --steps 2500 --seeds 100 &
run k8_req_d35 --costs $FLAT --cond $Q8 --noise-from $T --drift 0.35 --drift-period 100 --regime-every 40 --regime-spread 0.4 --paired --steps 2500 --seeds 100 &
run k8_noise_d25 --costs $FLAT --cond $Q8 --noise-from $T --drift 0.25 --drift-period 300 --steps 2500 --seeds 100 &
run k8_trace_spikes --costs 0.362,0.574,0.601,0.605,0.613,0.640,0.641,0.608,0.691 --cond $Q8 --noise 0.15 --drift 0.35 --drift-period 100 --spike-rate 0.02 --spike-factor 2 --profile 0.244,0.423,0.393,0.424,0.469,0.515,0.552,0.592,0.63 --steps 2500 --seeds 100 &
wait
run k4_d25 --costs 0.55,0.78,0.8,0.82,0.84 --cond 0.693,0.755,0.612,0.787 --noise 0.15 --drift 0.25 --drift-period 300 --steps 2500 --seeds 100 &
run b256_off --costs 14,26,36,46,56 --cond 0.8,0.8,0.8,0.8 --batch 256 --noise 0.05 --steps 2500 --seeds 60 &
run moe_b1 --costs 1.44,3.2,3.4,3.66,3.9 --cond 0.8,0.8,0.8,0.8 --batch 1 --noise 0.05 --paired --steps 1500 --seeds 120 &
run moe_b1_req --costs 1.44,3.2,3.4,3.66,3.9 --cond 0.8,0.8,0.8,0.8 --batch 1 --noise 0.05 --paired --steps 1500 --seeds 150 --regime-every 100 --regime-spread 0.3 &
wait
run moe_b16 --costs 9.6,13,13.6,14.1,14.6 --cond 0.8,0.8,0.8,0.8 --batch 16 --noise 0.05 --paired --steps 1500 --seeds 40 &
run moe_b1_weak --costs 1.44,3.2,3.4,3.66,3.9 --cond 0.7,0.7,0.7,0.7 --batch 1 --noise 0.05 --paired --steps 1500 --seeds 120 &
run dense_b1_weak --costs 5.3,7.0,7.3,7.6,7.9 --cond 0.6,0.6,0.6,0.6 --batch 1 --noise 0.05 --paired --steps 1500 --seeds 80 &
wait
