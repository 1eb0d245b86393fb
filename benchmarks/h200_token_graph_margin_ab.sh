#!/usr/bin/env bash
# A/B of the token-graph cut (ADASPEC_TOKEN_GRAPH_MARGIN_MS, adaspec/engine/graph_sizes.py) on
# one GPU in one device call: the same load-experiment configuration at the same levels, one
# fresh server per margin, each in its own output directory (so no merge mixes them), then each
# server's cut from its start-up log and each part's table.
#   bash benchmarks/h200_token_graph_margin_ab.sh SHAPE [LABEL] [LEVELS] [MARGINS_MS]   (a margin `default`: none set)
# e.g. bash benchmarks/h200_token_graph_margin_ab.sh llama-8b chain3 16,64 0,1000
# (1000 ms captures token graphs up to --cuda-graph-max-tokens; 0 is the bare comparison; the
# default, `default` here, is max(0, 2 x launch - eager) of the eager forward below.) Session 22's feeds put a
# speculative server's eager steps with prompt rows 12-15 ms above replays of the same rows;
# this measures what a wider cut gives served throughput. Then, here, on each ab_M/ directory:
#   python3 benchmarks/feed_summary.py DIR/feeds      (steps with prompt rows by query rows)
# Run from the repository root with .whl/ = the server's wheels (carry [".whl"]).
set -u
SHAPE=$1; LABEL=${2:-chain3}; LEVELS=${3:-16,64}; MARGINS=${4:-0,1000}
. benchmarks/device_preamble.sh margin_ab
for m in ${MARGINS//,/ }; do
    left=$((${END_S:-585} - SECONDS)); [ $left -lt 30 ] && { echo "[margin $m skipped: ${left}s left]"; continue; }
    mkdir -p $R/ab_$m/feeds
    if [ $m = default ]; then unset ADASPEC_TOKEN_GRAPH_MARGIN_MS; else export ADASPEC_TOKEN_GRAPH_MARGIN_MS=$m; fi
    ADASPEC_POLICY_TRACE=$R/ab_$m/feeds/m$m le_part $left ab_$m $SHAPE $R/ab_$m m$m --only $LABEL --levels $LEVELS
    grep -h "token graphs stop\|captured" $R/ab_$m/part-m$m/server-*.log | cut -c1-220
    throughput_table $R/ab_$m
done
