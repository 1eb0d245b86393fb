#!/usr/bin/env python3
"""Run the load experiment's parts side by side, one GPU each, then merge them: the same
result as `load_experiment.py` running them one after another (every part sends the same
requests per level, and each configuration is a fresh server either way), in the wall time of
the longest part. On a 4- or 8-GPU machine an 8-wave experiment (about 21 minutes per shape
run serially on one H200, `--dry-run`) then fits one device call.

    python3 benchmarks/parallel_parts.py --out-dir DIR --gpus 0,1,2,3 \\
        --groups 'off;chain3,auto;tree16;thr32' -- --shape qwen3-30b-a3b --waves 8
    python3 benchmarks/parallel_parts.py ... --groups 'tree16@1,2,4,8,16,32,64;tree16@128,256;...'

`--groups`: parts separated by ';', each comma-separated configuration labels with optional
`@levels` (a part of those concurrency levels only, in place of the `--levels` after `--`); the
parts go to the GPUs in turn (a GPU with several runs them one after another). Everything
after `--` goes to every `load_experiment.py` run. Each part runs in DIR/_parts/gN (its own directory, so no two runs
merge the same files at once), with CUDA_VISIBLE_DEVICES=its GPU and its log in DIR/_parts;
then every part is merged into DIR (compare.json, compare.png, README.md). `--dry-run` prints
the commands.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOAD = HERE / "load_experiment.py"


def parse_groups(text: str) -> list[tuple[str, str | None]]:
    """'off;chain3,auto;tree16@1,2' -> [("off", None), ("chain3,auto", None), ("tree16", "1,2")]."""
    out = []
    for g in filter(None, (s.strip() for s in text.split(";"))):
        labels, _, levels = g.partition("@")
        if not labels.strip():
            raise ValueError(f"--groups: {g!r} names no configuration")
        out.append((labels.strip(), levels.strip() or None))
    if not out:
        raise ValueError("--groups: no parts")
    return out


def part_commands(groups, gpus: list[str], out_dir: Path, rest: list[str]) -> list[tuple[str, list[str], Path]]:
    """(GPU, load_experiment.py argv, part directory) per part, parts dealt to the GPUs in turn."""
    cmds = []
    for i, (labels, levels) in enumerate(groups):
        part_dir = out_dir / "_parts" / f"g{i}"
        argv = [sys.executable, str(LOAD), "--out-dir", str(part_dir), "--only", labels, *rest]
        if levels:
            argv += ["--levels", levels]
        cmds.append((gpus[i % len(gpus)], argv, part_dir))
    return cmds


def run(cmds, out_dir: Path) -> list[int]:
    """Each GPU's parts one after another, the GPUs side by side; the exit status of each part."""
    by_gpu: dict[str, list[int]] = {}
    for i, (gpu, _, _) in enumerate(cmds):
        by_gpu.setdefault(gpu, []).append(i)
    status = [None] * len(cmds)
    running: dict[str, tuple[int, subprocess.Popen]] = {}
    logs = out_dir / "_parts"
    logs.mkdir(parents=True, exist_ok=True)

    def start(gpu: str) -> None:
        i = by_gpu[gpu].pop(0)
        _, argv, _ = cmds[i]
        log = open(logs / f"g{i}.log", "w")
        print(f"[gpu {gpu}] part g{i}: {shlex.join(argv)}", flush=True)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        running[gpu] = (i, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))

    for gpu in by_gpu:
        start(gpu)
    t0 = time.monotonic()
    while running:
        time.sleep(1.0)
        for gpu, (i, proc) in list(running.items()):
            if proc.poll() is None:
                continue
            status[i] = proc.returncode
            print(f"[gpu {gpu}] part g{i} exited {proc.returncode} after {time.monotonic() - t0:.0f} s", flush=True)
            del running[gpu]
            if by_gpu[gpu]:
                start(gpu)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    mine = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="benchmarks/parallel_parts.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--gpus", required=True, help="comma-separated GPU indices, e.g. 0,1,2,3")
    p.add_argument("--groups", required=True, help="parts: 'off;chain3,auto;tree16@1,2,4'")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(mine)
    for word in ("--out-dir", "--only", "--merge", "--part", "--tar"):
        if word in rest:
            p.error(f"{word} after '--': this script sets it per part")
    try:
        groups = parse_groups(a.groups)
    except ValueError as e:
        p.error(str(e))
    gpus = [g.strip() for g in a.gpus.split(",") if g.strip()]
    if not gpus:
        p.error("--gpus: none given")
    out_dir = Path(a.out_dir)
    cmds = part_commands(groups, gpus, out_dir, rest)
    merge = [sys.executable, str(LOAD), "--out-dir", str(out_dir), "--merge", *(str(d) for _, _, d in cmds)]
    if a.dry_run:
        for gpu, cmd, _ in cmds:
            print(f"CUDA_VISIBLE_DEVICES={gpu} {shlex.join(cmd)}")
        print(shlex.join(merge))
        return 0
    status = run(cmds, out_dir)
    have = [d for (_, _, d) in cmds if any(d.glob("part-*/compare.json"))]
    if not have:
        print("no part produced a compare.json", file=sys.stderr)
        return 1
    rc = subprocess.run(merge[:5] + [str(d) for d in have]).returncode
    return rc or (1 if any(s != 0 for s in status) else 0)


if __name__ == "__main__":
    raise SystemExit(main())
