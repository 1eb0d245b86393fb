#!/usr/bin/env bash
# Device call 4 of 2026-12-02 (session 4): where logprobs' cost goes (torch.profiler, b = 64,
# plain vs logprobs=5), then the logprobs / penalties cost again after their rows land in
# pinned buffers. One tarball in $OUT, rewritten after every part.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p $R
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; date -u; } > $R/device.txt
part() { local lim=$1 name=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 $lim "$@" > $R/$name.log 2>&1;
         echo "[$name rc=$? $((SECONDS-t0))s]"; tail -n 4 $R/$name.log; tar czf $OUT/call4.tar.gz -C $R .; }
part 150 lp_profile python3 benchmarks/logprobs_profile.py --out $R/logprobs_profile.json
part 170 features python3 benchmarks/sampling_features_cost.py --shape llama-8b --batch 64 --device cuda \
    --output-len 256 --repeats 2 --waves 4 --out $R/sampling_features_cost.json
