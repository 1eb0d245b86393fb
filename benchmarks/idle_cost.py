#!/usr/bin/env python3
"""What a loaded but unused draft costs (issue 27): throughput of a server with the draft loaded
and every request sent with "speculate": false (`idle`), over a plain server (`off`), with a
second plain server (`off2`) in the same call as the noise floor. One command per device call
(each stays under 10 minutes), then one local command for the ratios:

    python3 benchmarks/idle_cost.py --out-dir DIR --levels 1,64 --tar $OUT/idle-a.tar.gz
    python3 benchmarks/idle_cost.py --out-dir DIR --levels 256 --waves 12 --tar $OUT/idle-b.tar.gz
    python3 benchmarks/idle_cost.py --out-dir DIR --merge idle-a.tar.gz idle-b.tar.gz

Each run is `load_experiment.py` (the Llama-3.1-8B shape, bf16, dummy weights, random 512-token
prompts, 256 output tokens, closed loop; `--waves` x concurrency requests a level, default 24)
with the configurations off, idle (always, chain 3), off2, in that order. Every run and every
merge writes DIR/idle_cost.json from DIR/compare.json: per concurrency, idle/off, off2/off
(the noise floor) and idle over the mean of the two plain runs, and whether the idle server
verified nothing (`idle_verify_steps` 0). Target: idle/plain >= 0.995 at 1 and 64, within the
noise at 256.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = "off,idle=always[--num-steps 3 --topk 1 --request-json '{\"speculate\": false}'],off2=off"


def ratios(compare: dict) -> dict:
    """{concurrency: {...}} from a compare.json holding the configurations off, idle, off2."""
    def by_level(label):
        levels = (compare.get("configs", {}).get(label) or {}).get("levels") or []
        return {lv["concurrency"]: lv for lv in levels if lv.get("completed")}

    off, idle, off2 = by_level("off"), by_level("idle"), by_level("off2")
    out = {}
    for c in sorted(set(off) & set(idle)):
        t_off, t_idle = off[c]["output_throughput"], idle[c]["output_throughput"]
        row = {"off_tok_s": t_off, "idle_tok_s": t_idle, "idle_over_off": t_idle / t_off,
               "idle_verify_steps": idle[c].get("spec_verify_steps")}
        if c in off2:
            t2 = off2[c]["output_throughput"]
            row.update(off2_tok_s=t2, off2_over_off=t2 / t_off, idle_over_plain=2 * t_idle / (t_off + t2))
        out[c] = row
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--levels", default="1,64", help="concurrency levels of this run (default: %(default)s)")
    p.add_argument("--waves", default="24", help="requests per level = waves x concurrency")
    p.add_argument("--tar", default=None, help="also pack this run's part directory into FILE.tar.gz")
    p.add_argument("--merge", nargs="+", default=None, help="merge part tarballs / dirs; run nothing")
    a, rest = p.parse_known_args(argv)   # anything else goes to load_experiment.py as is
    le = [sys.executable, str(REPO / "benchmarks" / "load_experiment.py"), "--out-dir", a.out_dir]
    if a.merge:
        cmd = le + ["--merge", *a.merge]
    else:
        cmd = le + ["--configs", CONFIGS, "--levels", a.levels, "--waves", a.waves, "--no-llm-generate",
                    "--part", "idle-c" + a.levels.replace(",", "_")] + (["--tar", a.tar] if a.tar else []) + rest
    rc = subprocess.call(cmd)
    compare = Path(a.out_dir) / "compare.json"
    if not compare.exists():
        print(f"no {compare}: nothing to compare", file=sys.stderr)
        return rc or 1
    res = {"configs": CONFIGS, "command": cmd, "by_concurrency": ratios(json.loads(compare.read_text()))}
    (Path(a.out_dir) / "idle_cost.json").write_text(json.dumps(res, indent=2) + "\n")
    for c, row in res["by_concurrency"].items():
        noise = f", off2/off {row['off2_over_off']:.4f}" if "off2_over_off" in row else ""
        print(f"concurrency {c}: idle/off {row['idle_over_off']:.4f}{noise}, "
              f"idle verify steps {row['idle_verify_steps']}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
