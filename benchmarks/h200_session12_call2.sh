#!/usr/bin/env bash
# Device call 2 of session 12 (2026-12-04): issue 19, the parts of a host-bound step's launch on
# the demo pair at batch 1 (benchmarks/launch_anatomy.py), with programmatic dependent launch on
# and off.
. benchmarks/device_preamble.sh call2
part 150 anatomy python3 benchmarks/launch_anatomy.py --configs off,chain4 --out $R/anatomy.json
cat $R/anatomy.log | grep -v "^ - \|nanobind"
ADASPEC_PDL=0 part 100 anatomy_nopdl python3 benchmarks/launch_anatomy.py --configs chain4 --out $R/anatomy_nopdl.json
cat $R/anatomy_nopdl.log | grep -v "^ - \|nanobind"
