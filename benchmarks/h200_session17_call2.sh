#!/usr/bin/env bash
# Device call 2 of session 17 (2026-12-05), issue 19: is auto's extra host time per step on the
# demo pair (session 16 served: depth-8 steps 1.40 ms median against always's 1.02) the policy,
# its start-up profile, or the host's speed of the moment? Offline: each configuration in a
# fresh process, twice, interleaved; then the same trio in one process. Served: always, auto and
# auto without the start-up profile, 96 held-out prompts at C=1, each server's policy feed kept.
. benchmarks/device_preamble.sh call2
for i in 1 2; do for c in chain8 auto8 auto8-noprofile; do
  part 60 host_${c}_$i python3 benchmarks/host_profile.py --model demo --configs $c --steps 150 --warmup 20 \
      --prompt-len 128 --top 40 --out $R/host_${c}_$i.json
done; done
part 90 host_inproc python3 benchmarks/host_profile.py --model demo --configs auto8-noprofile,auto8,chain8 \
    --steps 150 --warmup 20 --prompt-len 128 --out $R/host_inproc.json
export ADASPEC_POLICY_TRACE=$R/served/policy
part 240 served python3 -m adaspec.cli compare --configs "always,auto,autonp=auto[--spec-auto-profile false]" \
    --rounds 1 --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 96 \
    --num-warmup 2 --device cuda --out-dir $R/served
grep -h "^chain8\|^auto8" $R/host_*.log
grep -h "^   1 \|^-- \|round\|median" $R/served.log | head -20
grep -h "shutdown" $R/served/server-*.log | cut -c1-330
