# Sourced by a device call script with its tarball's name: `. benchmarks/device_preamble.sh callN`.
# Installs the carried wheels (.whl/), writes $R/device.txt (GPU, driver, date, commit), and
# defines `part LIMIT NAME CMD...`: CMD under a time limit, its output in $R/NAME.log, then
# $OUT/callN.tar.gz rewritten from $R, so a call cut short still returns what finished;
# `le_part`, one part of the load experiment as issue 20's runs take it; and `throughput_table
# DIR`, a load-experiment directory's throughput table.
set -u
TARBALL=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; date -u; git log -1 --format=%H; } > $R/device.txt
part() { local lim=$1 name=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 $lim "$@" > $R/$name.log 2>&1;
         echo "[$name rc=$? $((SECONDS-t0))s]"; tail -n 3 $R/$name.log; tar czf $OUT/$TARBALL.tar.gz -C $R .; }
# le_part LIMIT LOG SHAPE OUT_DIR PART ARGS...: `part` of load_experiment.py at 8 waves a level,
# simulated acceptance 0.8, without the LLM.generate reference (ARGS: --only, --levels).
le_part() { local lim=$1 log=$2 shape=$3 dir=$4 name=$5; shift 5
            part $lim $log python3 benchmarks/load_experiment.py --shape $shape --out-dir $dir --part $name "$@" \
                --waves 8 --accept-rate 0.8 --server-timeout 240 --no-llm-generate; }
# The throughput table of a load-experiment directory's README (load_experiment.py writes it).
throughput_table() { awk '/^## Output throughput/{on=1;next} on&&/^## /{exit} on&&/^\|/' $1/README.md; }
export PYTHONPATH=/tmp/site:$PWD
