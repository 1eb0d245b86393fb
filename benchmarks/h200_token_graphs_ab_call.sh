#!/usr/bin/env bash
# Token graphs served, A/B on the Qwen3-30B-A3B shape (issue 20), one device call: off and chain 3
# with token graphs (the default) and without them (`--cuda-graph-max-tokens 0`: prompt and mixed
# steps eager, decode and verify graphs kept), C = 4 / 16 / 64, 4 waves, simulated acceptance 0.8.
# Every server writes its policy feed to $R/le_ab/feeds/ (benchmarks/feed_summary.py: the cost of
# steps with prompt rows) and its shutdown stats (launches.target_eager, cuda_graph_token_rows).
#   bash benchmarks/h200_token_graphs_ab_call.sh CALLN   (carry [".whl"]; kind nvidia-h200, needs_h200)
# `load_experiment.py --dry-run` estimates about 260 s of serving plus four server starts.
set -u
. benchmarks/device_preamble.sh $1
mkdir -p $R/le_ab/feeds; export ADASPEC_POLICY_TRACE=$R/le_ab/feeds/ab
part ${END_S:-570} le_ab python3 benchmarks/load_experiment.py --shape qwen3-30b-a3b --out-dir $R/le_ab --part ab \
    --extra-configs "chain3ntg=always[--num-steps 3 --topk 1 --cuda-graph-max-tokens 0],offntg=off[--cuda-graph-max-tokens 0]" \
    --only off,offntg,chain3,chain3ntg --levels 4,16,64 --waves 4 --accept-rate 0.8 --no-llm-generate --server-timeout 240
grep -A8 "Output throughput" $R/le_ab/README.md
