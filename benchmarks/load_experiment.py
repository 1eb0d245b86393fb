#!/usr/bin/env python3
"""The load experiment (issue 10): ONE command that runs `adaspec compare` on the
Llama-3.1-8B shape and writes compare.json, compare.png and README.md.

    python3 benchmarks/load_experiment.py [--out-dir DIR]                     # everything
    python3 benchmarks/load_experiment.py --out-dir DIR --part a --only off,chain3,thr32,idle \
        --tar $OUT/load_experiment-a.tar.gz
    python3 benchmarks/load_experiment.py --out-dir DIR --part b --only tree16,auto \
        --hf-probe P --tar $OUT/load_experiment-b.tar.gz
    python3 benchmarks/load_experiment.py --out-dir DIR --merge PART [PART ...]  # dirs or tars
    python3 benchmarks/load_experiment.py --dry-run [...]                     # plan + time estimate

What it runs: the 8B shape (bf16, random weights: `--load-format dummy`, speculation with a
SIMULATED acceptance rate, 0.8 by default), random 512-token prompts, 256 output tokens,
ignore_eos, closed loop at concurrency 1..256, each configuration a fresh server
(`adaspec.bench.experiment.default_configs`): off; chain3 = always, chain of 3; tree16 =
always, 16-token tree (topk 4, 2 steps); thrN = threshold:N with chain 3 (--threshold,
default 32); auto (chains of 0..4, --auto-flags); idle = the draft loaded but unused
(always, chain 3, every request sent with "speculate": false).
Each level sends max(waves x concurrency, min-prompts) requests; a level's requests are the
same whatever part runs it. In the part that runs `off`, an offline `LLM.generate` of exactly
the requests of the highest level gives the server/engine ratio; `--hf-probe` also runs
transformers' continuous batching probe (hf_cb_probe.py, 256 requests).

A run writes DIR/part-NAME/ (the compare result, server logs, part.json, references) and then
merges every DIR/part-*/ into DIR/compare.json, DIR/compare.png and DIR/README.md, so parts
run in separate device calls combine with `--merge` (which copies the part directories into
DIR first). Selection: `--only LABELS` (configurations), `--levels` (concurrency levels).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# Servers and the offline reference run as `python -m adaspec...` subprocesses.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

from adaspec.bench.cli import _int_list  # noqa: E402
from adaspec.bench import experiment as X  # noqa: E402
from adaspec.bench.configs import parse_configs  # noqa: E402
from adaspec.bench.report import plot_runs, write_json  # noqa: E402
from adaspec.bench.shapes import SHAPES, write_shape_dirs  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "h200" / "load_experiment"
DEFAULT_OUT_TP = REPO / "benchmarks" / "results" / "h200x2" / "load_experiment_tp2"
SCRIPT = "python3 benchmarks/load_experiment.py"



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=SCRIPT, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=None,
                   help=f"default: {DEFAULT_OUT} ({DEFAULT_OUT_TP} with --tensor-parallel-size 2 and up)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="every server and the offline reference shard the target over this many GPUs")
    p.add_argument("--part", default=None,
                   help="name of this part (DIR/part-NAME); default 'all', or the selected labels")
    p.add_argument("--only", default=None, help="comma-separated configuration labels to run")
    p.add_argument("--levels", type=_int_list, default=list(X.LEVELS),
                   help="closed-loop concurrency levels (default %(default)s)")
    p.add_argument("--threshold", type=int, default=32,
                   help="N of the threshold configuration thrN (default %(default)s)")
    p.add_argument("--auto-flags", default=X.AUTO_FLAGS,
                   help="draft-shape flags of `auto` (default %(default)r: chains of 0..4)")
    p.add_argument("--configs", default=None,
                   help="replace the configuration list (adaspec compare --configs syntax)")
    p.add_argument("--extra-configs", default=None,
                   help="configurations appended to the list, e.g. "
                        "'autotree=auto[--num-steps 2 --topk 4 --num-draft-tokens 16]'")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b",
                   help="random-weight shape (default %(default)s); ignored with --model")
    p.add_argument("--model", default=None, help="a real target checkpoint instead of --shape")
    p.add_argument("--draft", default=None, help="with --model: its EAGLE-3 head")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--accept-rate", type=float, default=0.8,
                   help="simulated acceptance rate (default %(default)s)")
    p.add_argument("--real-acceptance", action="store_true",
                   help="do not simulate acceptance (only meaningful with real --model/--draft)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--waves", type=float, default=2.0,
                   help="requests per level = max(waves x concurrency, --min-prompts)")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--num-warmup", type=int, default=2,
                   help="concurrent warm-up requests per server, not counted")
    p.add_argument("--engine-flags", default="",
                   help="more `adaspec serve` engine flags for every server and the reference")
    p.add_argument("--server-timeout", type=float, default=300.0)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--llm-generate", dest="llm_generate", action="store_true", default=None,
                   help="run the offline LLM.generate reference (default: when `off` is in this part)")
    g.add_argument("--no-llm-generate", dest="llm_generate", action="store_false")
    p.add_argument("--reference-timeout", type=float, default=300.0)
    p.add_argument("--hf-probe", default=None, help="path of hf_cb_probe.py to run (HF_NREQ = top level)")
    p.add_argument("--hf-timeout", type=float, default=300.0)
    p.add_argument("--tar", default=None, metavar="FILE.tar.gz",
                   help="also pack this part's directory into one file (the device returns few files)")
    p.add_argument("--merge", nargs="+", default=None, metavar="PART",
                   help="run nothing: copy these parts (part directories, directories holding part-*/, "
                        "or --tar files) into --out-dir and merge every part there")
    p.add_argument("--dry-run", action="store_true", help="print the plan and a time estimate")
    return p


# ----------------------------------------------------------------------------- plan

def plan(a: argparse.Namespace) -> dict:
    spec = a.configs or X.default_configs(a.threshold, a.auto_flags)
    if a.extra_configs:
        spec += "," + a.extra_configs
    all_cfgs = parse_configs(spec)
    labels = [c.label for c in all_cfgs]
    if a.only:
        only = [s.strip() for s in a.only.split(",") if s.strip()]
        unknown = [s for s in only if s not in labels]
        if unknown:
            raise ValueError(f"--only: unknown labels {unknown}; the configurations are {labels}")
        selected = [c for c in all_cfgs if c.label in only]
    else:
        selected = all_cfgs
    levels = sorted(set(a.levels))
    counts = X.prompts_per_level(levels, a.waves, a.min_prompts)
    starts = X.prompt_starts(levels, counts, a.num_warmup, X.LEVELS, a.waves, a.min_prompts)
    roles = X.roles_for(a.threshold)
    name = a.part or ("all" if not a.only and a.levels == list(X.LEVELS)
                      else "_".join(c.label for c in selected) + ("" if a.levels == list(X.LEVELS)
                                                                  else "-c" + "_".join(map(str, levels))))
    if a.part is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", a.part):
        raise ValueError(f"--part {a.part!r}: use letters, digits, '.', '_' and '-'")
    name = re.sub(r"[^A-Za-z0-9._-]", "-", name)
    llm = a.llm_generate if a.llm_generate is not None else any(c.label == roles["off"] for c in selected)
    return {"spec": spec, "all_labels": labels, "selected": selected, "levels": levels,
            "counts": counts, "starts": starts, "roles": roles, "name": name, "llm_generate": llm,
            "high": max(levels)}


def model_dirs(a: argparse.Namespace) -> tuple[str, str | None, bool]:
    """(target, draft, dummy weights)."""
    if a.model:
        return a.model, a.draft, False
    t, d = write_shape_dirs(a.shape)
    return t, d, True


def engine_words(a: argparse.Namespace, dummy: bool) -> list[str]:
    words = ["--device", a.device, "--dtype", a.dtype, "--seed", str(a.seed)]
    if a.tensor_parallel_size > 1:
        words += ["--tensor-parallel-size", str(a.tensor_parallel_size)]
    if dummy:
        words += ["--load-format", "dummy"]
    return words + shlex.split(a.engine_flags)


def compare_argv(a, P: dict, target: str, draft: str | None, dummy: bool, vocab: int,
                 part_dir: Path) -> list[str]:
    argv = ["--model", target] + (["--draft", draft] if draft else []) + engine_words(a, dummy)
    if not a.real_acceptance:
        argv += ["--spec-simulate-accept-rate", str(a.accept_rate)]
    return argv + [
        "--configs", ",".join(c.to_text() for c in P["selected"]),
        "--dataset", "random", "--input-len", str(a.input_len), "--output-len", str(a.output_len),
        "--vocab-size", str(vocab), "--concurrency", ",".join(map(str, P["levels"])),
        "--num-prompts", ",".join(map(str, P["counts"])),
        "--prompt-starts", ",".join(map(str, P["starts"])), "--num-warmup", str(a.num_warmup),
        "--server-timeout", str(a.server_timeout), "--out-dir", str(part_dir), "--disable-tqdm"]


def reference_argv(a, P: dict, target: str, dummy: bool, vocab: int, part_dir: Path) -> list[str]:
    i = P["levels"].index(P["high"])
    return [sys.executable, "-m", "adaspec.bench.offline", "--model", target, *engine_words(a, dummy),
            "--input-len", str(a.input_len), "--output-len", str(a.output_len),
            "--vocab-size", str(vocab), "--num-prompts", str(P["counts"][i]),
            "--first-prompt", str(P["starts"][i]), "--num-warmup", str(a.num_warmup),
            "--json", str(part_dir / "llm_generate.json")]


# ----------------------------------------------------------------------------- time estimate

#: Rough H200 step times (ms) of the 8B shape at 512-token context, from
#: results/h200/fast_path (off, chain 3, tree 16 at b = 1, 16, 64, 256); the b = 256 verify
#: figures are guesses. Only for --dry-run's estimate.
STEP_MS = {"off": {1: 5.3, 16: 5.9, 64: 8.6, 256: 15.8},
           "chain": {1: 7.6, 16: 8.9, 64: 14.0, 256: 32.0},
           "tree": {1: 14.3, 16: 18.8, 64: 62.4, 256: 230.0}}
#: The MoE shape: guesses at 1.5x the roofline of moe_physics_probe.py (issue 20's table) until
#: a run measures them. Only for --dry-run's estimate.
STEP_MS_BY_SHAPE = {
    "llama-8b": STEP_MS,
    "qwen3-30b-a3b": {"off": {1: 2.9, 16: 13.4, 64: 20.6, 256: 24.0},
                      "chain": {1: 5.5, 16: 19.8, 64: 20.9, 256: 24.1},
                      "tree": {1: 9.0, 16: 25.0, 64: 40.0, 256: 120.0}},
}
PREFILL_MS_PER_TOKEN = 0.02
SERVER_START_S = 20.0


def _interp(table: dict[int, float], b: int) -> float:
    pts = sorted(table.items())
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if b <= b1:
            return t0 + (t1 - t0) * (max(b, b0) - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = pts[-2], pts[-1]
    return t1 + (t1 - t0) / (b1 - b0) * (b - b1)


def _flag(flags, name: str, default: int) -> int:
    flags = list(flags)
    return int(flags[flags.index(name) + 1]) if name in flags else default


def level_seconds(cfg, c: int, n: int, a) -> float:
    """Rough seconds of one level of configuration `cfg` (on an H200, `a.shape`'s step times)."""
    acc = 0.0 if a.real_acceptance else a.accept_rate
    table = STEP_MS_BY_SHAPE.get(getattr(a, "shape", None), STEP_MS)

    def per_token(kind: str, k: int) -> float:
        tokens = sum(acc ** i for i in range(k + 1)) if kind != "off" else 1.0
        return _interp(table[kind], c) / tokens

    steps, topk = _flag(cfg.flags, "--num-steps", 3), _flag(cfg.flags, "--topk", 1)
    kind = "tree" if topk > 1 else "chain"
    spec = per_token(kind, steps)
    off = per_token("off", 0)
    if cfg.policy != "off" and cfg.request_fields.get("speculate") is False:
        return level_seconds(parse_configs("x=off")[0], c, n, a) * 1.05   # the draft idles
    ms = {"off": off, "always": spec,
          "threshold": spec if c <= (cfg.disable_bs or 0) and cfg.disable_bs != 1 else off * 1.05,
          "auto": min(off, min(per_token(kind, d) for d in range(1, steps + 1)))}[cfg.policy]
    waves = n / c
    return waves * (c * a.input_len * PREFILL_MS_PER_TOKEN + a.output_len * ms) / 1000.0


def estimate(a, P: dict) -> dict:
    per_cfg = {}
    for cfg in P["selected"]:
        per_cfg[cfg.label] = SERVER_START_S + 2.0 + sum(
            level_seconds(cfg, c, n, a) for c, n in zip(P["levels"], P["counts"]))
    out = {"configs": per_cfg}
    if P["llm_generate"]:
        i = P["levels"].index(P["high"])
        off = parse_configs("off")[0]
        out["llm_generate"] = SERVER_START_S + level_seconds(off, P["high"], P["counts"][i], a)
    if a.hf_probe:
        out["hf_cb"] = 90.0
    out["total"] = sum(per_cfg.values()) + out.get("llm_generate", 0.0) + out.get("hf_cb", 0.0)
    return out


# ----------------------------------------------------------------------------- run

def device_name() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            return "; ".join(line.strip() for line in r.stdout.strip().splitlines())
    except (OSError, subprocess.SubprocessError):
        pass
    return f"no GPU (nvidia-smi unavailable): {platform.machine()} CPU, {os.cpu_count()} cores"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> dict:
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"rc": rc, "seconds": time.monotonic() - t0, "log": log.name}


def run_part(a, P: dict, argv: list[str]) -> Path:
    from adaspec.bench.compare import compare_main

    out = Path(a.out_dir)
    part_dir = out / f"part-{P['name']}"
    part_dir.mkdir(parents=True, exist_ok=True)
    target, draft, dummy = model_dirs(a)
    vocab = int(json.loads((Path(target) / "config.json").read_text())["vocab_size"])
    cargv = compare_argv(a, P, target, draft, dummy, vocab, part_dir)
    meta = {"name": P["name"], "command": f"{SCRIPT} {shlex.join(argv)}",
            "compare_command": "adaspec compare " + shlex.join(cargv),
            "shared_flags": shlex.join(cargv[:cargv.index("--configs")]), "device": device_name(),
            "date": _now(), "configs": [c.label for c in P["selected"]], "all_labels": P["all_labels"],
            "roles": P["roles"], "levels": P["levels"], "num_prompts": P["counts"],
            "prompt_starts": P["starts"], "shape": None if a.model else a.shape,
            "target": target, "draft": draft, "dummy_weights": dummy,
            "accept_rate": None if a.real_acceptance else a.accept_rate,
            "input_len": a.input_len, "output_len": a.output_len, "num_warmup": a.num_warmup,
            "waves": a.waves, "min_prompts": a.min_prompts, "engine_flags": a.engine_flags,
            "estimate_s": estimate(a, P)}
    write_json(part_dir / "part.json", meta)
    t0 = time.monotonic()
    print(f"== part {P['name']}: adaspec compare {shlex.join(cargv)}", file=sys.stderr, flush=True)
    meta["compare_rc"] = compare_main(cargv)
    if P["llm_generate"]:
        cmd = reference_argv(a, P, target, dummy, vocab, part_dir)
        print(f"== LLM.generate reference: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        meta["llm_generate_run"] = _run_logged(cmd, part_dir / "llm_generate.log", a.reference_timeout)
        ref = part_dir / "llm_generate.json"
        if ref.exists():
            meta["llm_generate"] = {**json.loads(ref.read_text()), "level": P["high"]}
    if a.hf_probe:
        cmd = [sys.executable, a.hf_probe]
        print(f"== HF continuous batching probe: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        meta["hf_cb_run"] = _run_logged(cmd, part_dir / "hf_cb.log", a.hf_timeout,
                                        env={"OUT": str(part_dir), "HF_NREQ": str(P["high"])})
        hf = part_dir / "hf_cb.json"
        if hf.exists():
            meta["hf_cb"] = json.loads(hf.read_text())
    meta["duration_s"] = time.monotonic() - t0
    write_json(part_dir / "part.json", meta)
    return part_dir


def collect_parts(out: Path, sources: list[str] | None) -> list[Path]:
    """Copy `sources` (part directories, or directories holding part-*/) into `out`; return
    every part directory of `out`, sorted by name."""
    for src in sources or []:
        s = Path(src)
        if s.is_file() and s.name.endswith((".tar.gz", ".tgz", ".tar")):
            s = Path(tempfile.mkdtemp(prefix="load-experiment-"))
            with tarfile.open(src) as tf:
                try:
                    tf.extractall(s, filter="data")
                except TypeError:   # Python without extraction filters
                    tf.extractall(s)
        # a merged directory also holds a compare.json: its parts come first
        found = sorted(d for d in s.glob("part-*") if (d / "compare.json").exists())
        if not found and (s / "compare.json").exists():
            found = [s]
        if not found:
            raise SystemExit(f"--merge: no compare.json in {s} or its part-*/ directories")
        for d in found:
            name = d.name if d.name.startswith("part-") else "part-" + d.name
            dest = out / name
            if dest.resolve() == d.resolve():
                continue
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(d, dest)
    return sorted(d for d in out.glob("part-*") if (d / "compare.json").exists())


def merge_dir(out: Path, merge_command: str | None = None) -> dict:
    parts = [X.load_part(d) for d in collect_parts(out, None)]
    if not parts:
        raise SystemExit(f"no part-*/compare.json under {out}")
    metas = [p["part"] for p in parts]
    order = next((m.get("all_labels") for m in metas if m.get("all_labels")), None)
    roles = next((m.get("roles") for m in metas if m.get("roles")), None)
    merged = X.merge_parts(parts, order)
    for p in merged["parts"]:  # relative paths: the directory travels
        if p.get("dir"):
            p["dir"] = Path(p["dir"]).name
    levels = sorted({lv["concurrency"] for e in merged["configs"].values() for lv in e.get("levels") or []
                     if isinstance(lv.get("concurrency"), int)})
    if not levels:
        levels = [1]
    high, low = max(levels), min(levels)
    ratios = X.experiment_ratios(merged, roles, high=high, low=low, auto_off_at=tuple(levels[-2:]),
                                 idle_at=tuple(sorted({c for c in (64, high) if c in levels})) or (high,))
    merged["ratios"] = ratios
    merged["merge_command"] = merge_command
    m0 = metas[0]
    rate = m0.get("accept_rate")
    title = "Load experiment: adaspec server, closed loop, " + (
        f"Llama-3.1-8B shape ({m0.get('shape')})" if m0.get("shape") == "llama-8b"
        else f"shape {m0.get('shape')}" if m0.get("shape") else f"model {m0.get('target')}")
    counts = dict(zip(m0.get("levels") or [], m0.get("num_prompts") or []))
    for m in metas[1:]:
        counts.update(zip(m.get("levels") or [], m.get("num_prompts") or []))
    setup = [
        f"target `{m0.get('target')}`" + (" with random weights (`--load-format dummy`)" if m0.get("dummy_weights") else "")
        + f", draft `{m0.get('draft')}`",
        f"flags shared by every server: `{m0.get('shared_flags')}`",
        f"acceptance: {'SIMULATED, rate ' + format(rate, 'g') if rate is not None else 'real (draft model)'}",
        f"random prompts of {m0.get('input_len')} tokens, {m0.get('output_len')} output tokens, ignore_eos, "
        f"temperature 0, streaming `/v1/completions`",
        "closed loop; requests per level (concurrency: requests): "
        + ", ".join(f"{c}: {n}" for c, n in sorted(counts.items()))
        + f"; {m0.get('num_warmup')} concurrent warm-up requests per server, not counted",
        "each configuration is a fresh server; every level sends the same requests to every configuration",
        "`LLM.generate` reference: offline, config `off`, exactly the requests of the highest level, "
        "same engine flags, after a warm-up",
    ]
    text = X.render_readme(merged, ratios, title=title, setup=setup, merge_command=merge_command)
    write_json(out / "compare.json", merged)
    plot_title = title.replace("Load experiment: ", "") + f"\n{m0.get('input_len')} in / {m0.get('output_len')} out"
    plot_runs(out / "compare.png", merged["configs"], plot_title, merged.get("simulated_acceptance"))
    (out / "README.md").write_text(text)
    print(text)
    print(f"wrote {out / 'compare.json'}, {out / 'compare.png'}, {out / 'README.md'}")
    return merged


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = p.parse_args(argv)
    if a.out_dir is None:
        a.out_dir = str(DEFAULT_OUT_TP if a.tensor_parallel_size > 1 else DEFAULT_OUT)
    out = Path(a.out_dir)
    if a.merge:
        out.mkdir(parents=True, exist_ok=True)
        collect_parts(out, a.merge)
        merge_dir(out, f"{SCRIPT} {shlex.join(argv)}")
        return 0
    try:
        P = plan(a)
    except ValueError as e:
        p.error(str(e))
    if a.dry_run:
        if a.model:
            target, draft, dummy = a.model, a.draft, False
            vocab = int(json.loads((Path(target) / "config.json").read_text())["vocab_size"])
        else:
            target, draft, dummy = "TMP/target", "TMP/draft", True
            vocab = SHAPES[a.shape][0]["vocab_size"]
        part_dir = out / f"part-{P['name']}"
        est = estimate(a, P)
        print(f"part {P['name']}: levels {P['levels']}, requests per level {P['counts']}, "
              f"first prompts {P['starts']}")
        print("adaspec compare " + shlex.join(compare_argv(a, P, target, draft, dummy, vocab, part_dir)))
        if P["llm_generate"]:
            print(shlex.join(reference_argv(a, P, target, dummy, vocab, part_dir)))
        print("rough H200 estimate (s): " + ", ".join(f"{k} {v:.0f}" for k, v in est["configs"].items())
              + (f", LLM.generate {est['llm_generate']:.0f}" if "llm_generate" in est else "")
              + (f", HF probe {est['hf_cb']:.0f}" if "hf_cb" in est else "")
              + f"; total {est['total']:.0f} s = {est['total'] / 60:.1f} min")
        return 0
    part_dir = run_part(a, P, argv)
    merged = merge_dir(out)
    if a.tar:
        Path(a.tar).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(a.tar, "w:gz") as tf:
            tf.add(part_dir, arcname=part_dir.name)
        print(f"packed {part_dir} into {a.tar}")
    failed = [k for k, e in merged["configs"].items() if e.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
