#!/usr/bin/env python3
"""Rebuild a load-experiment part directory from the log of an `adaspec compare` run that was
cut short before it wrote compare.json (the per-configuration tables it printed are all that
is left), so that `load_experiment.py --merge` can unite it with the parts that finished.

    python3 benchmarks/compare_from_log.py LOG --part a --out-dir DIR [--date ...] [--device ...]

Writes DIR/part-NAME/compare.json (one level per printed table row: output tok/s, p50/p99 TTFT
and TPOT, mean ITL and E2EL, acceptance length) and part.json (the source log, marked as
recovered). A configuration whose table was not printed is left out.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

COLUMNS = ("concurrency", "completed", "failed", "request_throughput", "output_throughput",
           "total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "mean_itl_ms", "mean_e2el_ms", "acceptance_length")
ROW = re.compile(r"^\s*\d+\s+\d+\s+\d+\s+[\d.]+")


def parse(text: str) -> dict[str, dict]:
    """{config: {"server_command": str | None, "levels": [level dict, ...]}} from a compare log."""
    configs: dict[str, dict] = {}
    commands: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if m := re.match(r"^== (\S+): starting (.*)$", line):
            commands[m.group(1)] = m.group(2)
            current = None
        elif m := re.match(r"^-- (\S+)\s*$", line):
            current = m.group(1)
            configs[current] = {"server_command": commands.get(current), "levels": []}
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
    a = ap.parse_args(argv)
    configs = parse(Path(a.log).read_text())
    if not configs:
        raise SystemExit(f"{a.log}: no `adaspec compare` table found")
    d = Path(a.out_dir) / f"part-{a.part}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "compare.json").write_text(json.dumps({"tool": "benchmarks/compare_from_log.py", "date": a.date,
                                                "simulated_acceptance": a.simulated_acceptance,
                                                "configs": configs}, indent=1))
    (d / "part.json").write_text(json.dumps({"name": a.part, "date": a.date, "device": a.device,
                                             "configs": list(configs), "recovered_from_log": a.log,
                                             "levels": sorted({lv["concurrency"] for c in configs.values()
                                                               for lv in c["levels"]})}, indent=1))
    found = ", ".join(f"{k} ({len(v['levels'])} levels)" for k, v in configs.items())
    print(f"{d}: {found}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
