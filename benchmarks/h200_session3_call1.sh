#!/usr/bin/env bash
# Device call 1 of 2026-12-02: (a) the demo pair server compare (off, always, auto) at
# concurrency 1 after auto's start-up profile prices speculative steps with the shift in flight
# (issue 19); (b) the MoE load experiment on the Qwen3-30B-A3B shape (issue 20): off, chain 3
# and auto at concurrency 1/16/64/256, plus the offline LLM.generate reference.
# .whl/ = the server's wheels (the image lacks fastapi & co), .carry/tools = ../shared/tools.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/tmp/c1; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; git rev-parse HEAD 2>/dev/null; } > $R/device.txt 2>&1
timeout 200 python3 -m adaspec.cli compare --configs off,always,auto --concurrency 1 --dataset tests/data/demo_heldout.jsonl \
    --output-len 64 --num-prompts 16 --num-warmup 1 --num-steps 4 --device cuda --out-dir $R/demo_compare > $R/demo_compare.log 2>&1
echo "demo compare rc=$?"; tail -n 8 $R/demo_compare.log
timeout 370 python3 benchmarks/load_experiment.py --shape qwen3-30b-a3b --only off,chain3,auto --levels 1,16,64,256 \
    --waves 1 --out-dir $R/moe_load > $R/moe_load.log 2>&1
echo "moe load rc=$?"; tail -n 30 $R/moe_load.log
tar czf $OUT/call1.tar.gz -C $R .
