#!/usr/bin/env bash
# Device call 1 of session 11 (2026-12-03): issue 19, where served `auto` loses its time at
# concurrency 1 on the demo pair. Served off / auto / always (host split logged at shutdown),
# the same auto / always servers under cProfile (ADASPEC_ENGINE_PROFILE), the start-up
# profile's cost table repeated, offline demo_c1 with the host split, and host_profile with
# the device's busy time per step.
. benchmarks/device_preamble.sh call1
mkdir -p $R/prof
part 150 served python3 -m adaspec.cli compare --configs "off,auto,always" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/served
tail -n 8 $R/served.log; grep -h "shutdown" $R/served/server-*.log | cut -c1-900
ADASPEC_ENGINE_PROFILE=$R/prof/engine part 120 served_prof python3 -m adaspec.cli compare --configs "auto,always" \
    --concurrency 1 --dataset tests/data/demo_heldout.jsonl --output-len 128 --num-prompts 48 --num-warmup 2 \
    --num-steps 4 --device cuda --out-dir $R/served_prof
tail -n 5 $R/served_prof.log
for f in $R/served_prof/server-*.log; do
  p=$(grep -o "profile written to .*" $f | awk '{print $4}')
  [ -n "$p" ] && python3 -c "
import pstats,sys
s=pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(35); s.sort_stats('cumulative').print_stats(45)" $p > $f.pstats 2>&1
  echo "== $f"; head -c 5000 $f.pstats | sed -n 1,60p
done
part 60 profile_table python3 - <<'PY'
import torch
from adaspec import LLM
from adaspec.demo import DEMO_HEAD, DEMO_TARGET
from adaspec.engine.profile import profile_step_times
llm = LLM(str(DEMO_TARGET), device="cuda", draft=str(DEMO_HEAD), speculation="auto", num_steps=4)
eng = llm.engine
print("policy table after start-up:", eng.policy.describe()["step_ms"])
for rep in range(3):
    out = profile_step_times(eng, eng.policy.shapes, max_batch=8, repeats=4)
    print(rep, {str(k): round(v * 1e3, 3) for k, v in sorted(out.items(), key=str)}, flush=True)
PY
part 100 offline python3 benchmarks/demo_c1.py --configs off,chain4,auto --rounds 1 --repeat 1 --out $R/demo_c1.json
part 80 host python3 benchmarks/host_profile.py --model demo --configs chain4,auto --kernels --out $R/host_demo.json
grep -h "step\|busy" $R/host.log | head -20
