#!/usr/bin/env bash
# Device call 6 of session 6 (2026-12-02): the demo pair offline at batch 1 after the auto policy's
# acceptance estimate changed (off, chain 4, auto; 100 warm-up steps so auto has probed).
. benchmarks/device_preamble.sh call6
part 150 host_demo python3 benchmarks/host_profile.py --model demo --configs off,chain4,auto --steps 300 \
    --warmup 100 --prompt-len 128 --out $R/host_demo.json
