#!/usr/bin/env bash
# Device call 1 of session 5 (2026-12-02): where the +4.8% decode-step regression of issue 21
# entered (the fast path at b = 64 for ten trees between 36ba152 and 6f2e1e8, carried as
# .carry/bis/<commit>: each tree's own gpu_fast_path.py), what an idle draft costs per step
# (issue 27: off vs idle at b = 1 and 64, with kernel profiles, and LLM.generate at b = 1), and
# the fused-MoE small path's launch sweep (issue 20). One tarball in $OUT, rewritten after
# every part, so a call cut short still returns what finished.
. benchmarks/device_preamble.sh call1
part 60 physics python3 .carry/tools/physics_probe.py --batch 1,64 --q 1 --ctx 512 --json $R/physics.json
for c in 36ba152 45b2c9a e3520a9 4f9114c 32f875b fdd73c2 6b22ca1 19f6367 15e3786 6f2e1e8; do
    dir=.carry/bis/$c
    PYTHONPATH=/tmp/site:$dir part 45 bis_$c python3 $dir/benchmarks/gpu_fast_path.py --physics $R/physics.json \
        --out $R/bis_$c.json --configs off --batches 64 --skip generate,throughput
done
part 120 idle python3 benchmarks/gpu_fast_path.py --physics $R/physics.json --out $R/idle.json \
    --configs off,idle --batches 1,64 --profile --skip throughput
part 110 moe_sweep python3 benchmarks/kernels/moe_sweep.py --json $R/moe_sweep.json --tokens 1,4,8,16 \
    --budget-s 80 --configs-out $R/moe_configs_small.json
