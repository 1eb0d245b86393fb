#!/usr/bin/env bash
# Device call 5 of session 12 (2026-12-04): the step's parts, this session's tree against its base
# (f5a76d6, carried in .carry/base), interleaved (call 4's base runs failed on a benchmark bug);
# the dense 8B fast path against physics_probe (PDL chosen on for it) to check the closing figures hold.
. benchmarks/device_preamble.sh call5
ln -sfn $PWD/adaspec/demo/target .carry/base/adaspec/demo/target
ln -sfn $PWD/adaspec/demo/head .carry/base/adaspec/demo/head
for i in 1 2; do
  PYTHONPATH=/tmp/site:$PWD/.carry/base part 60 anatomy_base$i python3 benchmarks/launch_anatomy.py --configs off,chain4 --out $R/anatomy_base$i.json
  part 60 anatomy_new$i python3 benchmarks/launch_anatomy.py --configs off,chain4 --out $R/anatomy_new$i.json
done
for f in base1 new1 base2 new2; do echo "## $f"; grep -h "^== \|launch  \|_prepare\|Shift.apply\|marks\|_timer\|CUDAGraph.replay" $R/anatomy_$f.log; done
part 25 physics python3 .carry/tools/physics_probe.py --batch 1,16,64,256 --q 1,4,16 --ctx 512 --json $R/physics.json
part 110 dense python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --configs off,chain3,tree16 \
    --skip generate,throughput --out $R/dense.json
grep -i "pdl\|ratio\|T(b" $R/dense.log | head -30; tail -n 25 $R/dense.log
