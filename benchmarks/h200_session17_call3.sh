#!/usr/bin/env bash
# Device call 3 of session 17 (2026-12-05), issue 19: why the demo pair's prefill step costs
# 5-11 ms served (13x a decode step), and whether the host's speed swings between processes
# (call 2: the same configuration at 0.78 and 1.32 ms per step) follow other load on the machine
# or the core the process runs on (vmstat alongside; one run pinned with taskset).
. benchmarks/device_preamble.sh call3
{ nproc; lscpu | grep -E "Model name|NUMA|MHz|Thread|Socket"; cat /proc/loadavg;
  cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null; nvidia-smi topo -m 2>/dev/null | head -5; } > $R/machine.txt 2>&1
vmstat 1 > $R/vmstat.log 2>&1 &
part 150 prefill python3 benchmarks/prefill_profile.py --configs off,chain8 --requests 40 --out $R/prefill.json
part 60 host_free python3 benchmarks/host_profile.py --model demo --configs off,chain8 --steps 150 --warmup 20 \
    --prompt-len 128 --top 30 --out $R/host_free.json
part 60 host_pinned taskset -c 3 python3 benchmarks/host_profile.py --model demo --configs off,chain8 --steps 150 \
    --warmup 20 --prompt-len 128 --top 30 --out $R/host_pinned.json
kill %1 2>/dev/null; tar czf $OUT/call3.tar.gz -C $R .
cat $R/machine.txt; grep -E "^(off|chain8):" $R/prefill.log $R/host_free.log $R/host_pinned.log
