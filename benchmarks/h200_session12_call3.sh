#!/usr/bin/env bash
# Device call 3 of session 12 (2026-12-04): issue 19. The step's parts with programmatic dependent
# launch on and off, interleaved in separate processes (call 2 ran them one after the other),
# then the demo pair served at concurrency 1 with PDL off (off / auto / always).
. benchmarks/device_preamble.sh call3
for i in 1 2; do
  ADASPEC_PDL=1 part 60 anatomy_pdl$i python3 benchmarks/launch_anatomy.py --configs off,chain4 --out $R/anatomy_pdl$i.json
  ADASPEC_PDL=0 part 60 anatomy_nopdl$i python3 benchmarks/launch_anatomy.py --configs off,chain4 --out $R/anatomy_nopdl$i.json
done
grep -h "^== \|launch \|_prepare\|raw replay" $R/anatomy_*.log
ADASPEC_PDL=0 part 200 served python3 -m adaspec.cli compare --configs "off,auto,always" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/served
tail -n 12 $R/served.log; grep -h "shutdown" $R/served/server-*.log | cut -c1-700
