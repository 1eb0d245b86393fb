#!/usr/bin/env python3
"""Rebuild a load-experiment part directory from the log of an `adaspec compare` run that was
cut short before it wrote compare.json (the per-configuration tables it printed are all that
is left), so that `load_experiment.py --merge` can unite it with the parts that finished.

    python3 benchmarks/compare_from_log.py LOG --part a --out-dir DIR [--date ...] [--device ...]

Writes DIR/part-NAME/compare.json (one level per printed table row: output tok/s, p50/p99 TTFT
and TPOT, mean ITL and E2EL, acceptance length) and part.json (the source log, marked as
recovered). A configuration whose table was not printed is left out. `--like` names a finished
part of the same experiment (same flags, shape, dataset and levels: say so only if true): its
descriptive fields are copied, so that the merged README describes the run, not "None".
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from adaspec.bench.report import SWEEP_COLUMNS

COLUMNS = ("concurrency",) + tuple(f for _, f, _ in SWEEP_COLUMNS)   # the table `adaspec compare` prints
ROW = re.compile(r"^\s*\d+\s+\d+\s+\d+\s+[\d.]+")


def parse(text: str) -> dict[str, dict]:
    """{config: {"policy", "server_command", "levels": [level dict, ...]}} from a compare log (the
    policy read from the server command's --speculation, None if it has none)."""
    configs: dict[str, dict] = {}
    commands: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if m := re.match(r"^== (\S+): starting (.*)$", line):
            commands[m.group(1)] = m.group(2)
            current = None
        elif m := re.match(r"^-- (\S+)\s*$", line):
            current = m.group(1)
            cmd = commands.get(current)
            policy = re.search(r"--speculation (\S+)", cmd or "")
            configs[current] = {"policy": policy.group(1) if policy else None, "server_command": cmd, "levels": []}
        elif current is not None and ROW.match(line):
            cells = line.split()
            if len(cells) != len(COLUMNS):
                continue
            lv: dict = {"mode": "closed"}
            for k, v in zip(COLUMNS, cells):
                lv[k] = None if v == "-" else (int(v) if k in ("concurrency", "completed", "failed") else float(v))
            configs[current]["levels"].append(lv)
        elif line.startswith("(latencies"):
            current = None
    return {k: v for k, v in configs.items() if v["levels"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--part", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--date", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--simulated-acceptance", type=float, default=None)
    ap.add_argument("--like", default=None, help="a finished part directory of the same experiment")
    a = ap.parse_args(argv)
    text = Path(a.log).read_text()
    configs = parse(text)
    if not configs:
        raise SystemExit(f"{a.log}: no `adaspec compare` table found")
    like_part, like_cmp = {}, {}
    if a.like:
        like_part = json.loads((Path(a.like) / "part.json").read_text())
        like_cmp = json.loads((Path(a.like) / "compare.json").read_text())
    own = ("name", "date", "device", "configs", "levels", "command", "compare_command", "duration_s",
           "compare_rc", "estimate_s", "llm_generate", "llm_generate_run", "hf_cb")
    meta = {k: v for k, v in like_part.items() if k not in own}
    run = re.search(r"^== part \S+: (adaspec compare .*)$", text, re.M)
    meta |= {"name": a.part, "date": a.date, "device": a.device, "configs": list(configs),
             "compare_command": run.group(1) if run else None, "recovered_from_log": a.log,
             "levels": sorted({lv["concurrency"] for c in configs.values() for lv in c["levels"]})}
    result = {k: v for k, v in like_cmp.items() if k not in ("configs", "comparison", "command", "date")}
    simulated = a.simulated_acceptance if a.simulated_acceptance is not None else result.get("simulated_acceptance")
    result |= {"tool": "benchmarks/compare_from_log.py", "date": a.date, "simulated_acceptance": simulated,
               "command": meta["compare_command"], "configs": configs}
    d = Path(a.out_dir) / f"part-{a.part}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "compare.json").write_text(json.dumps(result, indent=1))
    (d / "part.json").write_text(json.dumps(meta, indent=1))
    found = ", ".join(f"{k} ({len(v['levels'])} levels)" for k, v in configs.items())
    print(f"{d}: {found}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
