#!/usr/bin/env bash
# Device call 1 of session 6 (2026-12-02): the heap frozen after start-up (engine.gc_heap).
# logprobs / penalties offline at b = 64 (3 repeats, time in the collector recorded), a
# json_schema grammar at concurrency 64, and issue 27's idle server at concurrency 64 with 8
# waves. One tarball in $OUT, rewritten after every part.
. benchmarks/device_preamble.sh call1
part 200 features python3 benchmarks/sampling_features_cost.py --shape llama-8b --batch 64 --device cuda \
    --output-len 256 --repeats 3 --waves 4 --out $R/sampling_features_cost.json
part 110 structured python3 benchmarks/structured_h200.py --num-prompts 192 --json $R/structured_h200.json
part 240 idle64 python3 benchmarks/idle_cost.py --out-dir $R/idle --levels 64 --waves 8
