#!/usr/bin/env bash
# Device call 5 of session 5 (2026-12-02): issue 27's idle server at concurrency 256 (2 waves),
# the level the earlier calls did not reach. One tarball in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ nvidia-smi -L; date -u; } > $R/device.txt
export PYTHONPATH=/tmp/site:$PWD
timeout --kill-after=5 200 python3 benchmarks/idle_cost.py --out-dir $R/idle --levels 256 --waves 2 > $R/idle256.log 2>&1
echo "[idle256 rc=$?]"; tail -n 2 $R/idle256.log; tar czf $OUT/call5.tar.gz -C $R .
