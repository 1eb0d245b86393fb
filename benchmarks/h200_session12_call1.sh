#!/usr/bin/env bash
# Device call 1 of session 12 (2026-12-04): issue 19, where served `auto` loses its time at
# concurrency 1 on the demo pair (session 11's call 1, never run, trimmed). Served off / auto /
# always with the host split logged at shutdown; the same three servers under cProfile
# (ADASPEC_ENGINE_PROFILE); host_profile with the device's busy time per step.
. benchmarks/device_preamble.sh call1
mkdir -p $R/prof
part 170 served python3 -m adaspec.cli compare --configs "off,auto,always" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/served
tail -n 8 $R/served.log; grep -h "shutdown" $R/served/server-*.log | cut -c1-1500
ADASPEC_ENGINE_PROFILE=$R/prof/engine part 170 served_prof python3 -m adaspec.cli compare --configs "off,auto,always" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/served_prof
tail -n 5 $R/served_prof.log
for f in $R/served_prof/server-*.log; do
  p=$(grep -o "profile written to .*" $f | awk '{print $4}')
  [ -n "$p" ] && python3 -c "
import pstats,sys
s=pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(40); s.sort_stats('cumulative').print_stats(60)" $p > $f.pstats 2>&1
  echo "== $f"; sed -n 1,45p $f.pstats | cut -c1-160
done
part 80 host python3 benchmarks/host_profile.py --model demo --configs off,chain4,auto --kernels --out $R/host_demo.json
grep -h "step\|busy" $R/host.log | head -30
