#!/usr/bin/env bash
# Device call 1 of session 17 (2026-12-05).
# Issue 24: structured output at C=64 after the legalize walk's word-by-word search (session 16
# measured 0.737x with the unpacking walk). Issue 19: where `auto`'s extra host time per step goes
# on the demo pair (session 16 served: auto's depth-8 steps 1.40 ms median against always's 1.02),
# offline, chain 8 against auto 8 with and without the start-up profile, under cProfile.
. benchmarks/device_preamble.sh call1
part 200 structured python3 benchmarks/structured_h200.py --num-prompts 192 --json $R/structured_h200.json
part 200 host_demo python3 benchmarks/host_profile.py --model demo --configs chain8,auto8,auto8-noprofile \
    --steps 300 --prompt-len 128 --top 40 --out $R/host_demo.json
grep -E "ratio|plain|grammar" $R/structured.log | tail -8
grep -E "^(chain|auto)" $R/host_demo.log
