#!/usr/bin/env bash
# Device call 3 of 2026-12-02 (session 4): issue 24 after the host-side logprobs fix
# (json_schema grammar at concurrency 64; logprobs / penalties at b = 64 over 4 waves), and
# issue 21's fast-path A/B in the order old, new, old, new (decode steps at b = 64 and 256;
# old = 36ba152, before tensor parallelism, carried as .carry/old). One tarball in $OUT,
# rewritten after every part, so a call cut short still returns what finished.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; date -u; } > $R/device.txt
part() { local lim=$1 name=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 $lim "$@" > $R/$name.log 2>&1;
         echo "[$name rc=$? $((SECONDS-t0))s]"; tail -n 4 $R/$name.log; tar czf $OUT/call3.tar.gz -C $R .; }
export PYTHONPATH=/tmp/site:$PWD
part 100 structured python3 benchmarks/structured_h200.py --num-prompts 192 --json $R/structured_h200.json
part 170 features python3 benchmarks/sampling_features_cost.py --shape llama-8b --batch 64 --device cuda \
    --output-len 256 --repeats 2 --waves 4 --out $R/sampling_features_cost.json
part 60 physics python3 .carry/tools/physics_probe.py --batch 64,256 --q 1 --ctx 512 --json $R/physics.json
for run in old1 new1 old2 new2; do
    if [ ${run%?} = old ]; then dir=.carry/old; else dir=$PWD; fi
    PYTHONPATH=/tmp/site:$dir part 100 fast_$run python3 $dir/benchmarks/gpu_fast_path.py --physics $R/physics.json \
        --out $R/fast_$run.json --configs off --batches 64,256 --skip generate,throughput
done
