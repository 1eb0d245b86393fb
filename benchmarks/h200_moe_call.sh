#!/usr/bin/env bash
# benchmarks/moe_h200.sh in one device call, its files packed into one tarball under $OUT
# (the device returns at most 8 files). .carry/tools/ = ../shared/tools/.
REAL_OUT=$OUT
export OUT=/tmp/moe PROBE=.carry/tools/moe_physics_probe.py
bash benchmarks/moe_h200.sh
tar czf "$REAL_OUT/moe_call.tar.gz" -C /tmp/moe .
cat /tmp/moe/moe_h200.log
