#!/usr/bin/env bash
# Parts of the load experiment on ONE GPU, one after another in one device call, for a shape
# whose 8-wave run (issue 20's target 3) is longer than a call: each part is
# `load_experiment.py --only LABELS [--levels L]` into $R/le-SHAPE/part-NAME and the tarball is
# rewritten after each, so a call cut short returns the parts that finished. The parts of
# several calls join here with `load_experiment.py --out-dir DIR --merge PART_DIRS...`.
#   bash benchmarks/h200_load_parts_call.sh TARBALL SHAPE NAME=LABELS[@LEVELS] ... [--shape=SHAPE NAME=... ...]
# e.g. bash benchmarks/h200_load_parts_call.sh call1 qwen3-30b-a3b a=off@1,2,4,8,16,32,64 b=chain3
# A `--shape=SHAPE` among the parts sets the shape of the parts after it (into $R/le-SHAPE), so
# one call can finish one shape's run and start another's.
# Each part may run until END_S (default 585) seconds into the call: the device's 600 s limit less
# the tarball. Set END_S below the call's limit when less device time is left (a part cut by the
# device itself returns nothing; one cut here returns its compare.json of the levels that
# finished, which `adaspec compare` rewrites after each level, and --merge takes as it is).
# Every server writes its policy feed to $R/le-SHAPE/feeds/NAME.<pid>.jsonl (ADASPEC_POLICY_TRACE), which
# benchmarks/feed_summary.py reads: where each configuration's engine time went.
# Run from the repository root with .whl/ = the server's wheels (carry [".whl"]).
set -u
CALL=$1; SHAPE=$2; shift 2
. benchmarks/device_preamble.sh $CALL
for spec in "$@"; do
    [[ $spec == --shape=* ]] && { SHAPE=${spec#--shape=}; continue; }
    name=${spec%%=*}; rest=${spec#*=}; labels=${rest%%@*}
    levels=(); [[ $rest == *@* ]] && levels=(--levels "${rest#*@}")
    le=$R/le-$SHAPE; mkdir -p $le/feeds; export ADASPEC_POLICY_TRACE=$le/feeds/$name
    left=$((${END_S:-585} - SECONDS)); [ $left -lt 30 ] && { echo "[part $name skipped: ${left}s left]"; continue; }
    le_part $left le_$name $SHAPE $le $name --only $labels "${levels[@]}"
    throughput_table $le   # the shape's parts so far
done
