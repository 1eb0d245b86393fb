#!/usr/bin/env python3
"""The flip, side by side: each configuration's output throughput over `off` at every
concurrency, for the dense shape and the MoE shape, from two load-experiment compare.json files
(benchmarks/load_experiment.py). Writes a PNG (two panels, log2 concurrency) and a JSON of the
ratios, and prints the tables.

    python3 benchmarks/flip_plot.py --dense benchmarks/results/h100/load_experiment_dense_s22/compare.json \
        --moe benchmarks/results/h200/moe/load_experiment_s23/compare.json \
        --out benchmarks/results/h200/moe/flip.png

The two runs need not come from one call; the JSON records each file's path, dates and devices
(the panels' titles name the devices) so the reader can see whether they did.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def over_off(compare: dict) -> dict[str, dict[int, float]]:
    """{config: {concurrency: throughput / off's throughput}} of one compare.json (levels where
    `off` ran); `off` itself is left out."""
    out: dict[str, dict[int, float]] = {}
    for row in compare["comparison"]:
        thr = row["throughput"]
        base = thr.get("off")
        if not base:
            continue
        for cfg, v in thr.items():
            if cfg != "off" and v is not None:
                out.setdefault(cfg, {})[int(row["concurrency"])] = v / base
    return out


def table(name: str, ratios: dict[str, dict[int, float]]) -> str:
    levels = sorted({c for r in ratios.values() for c in r})
    cfgs = sorted(ratios)
    lines = [f"{name}: throughput / off", "| concurrency | " + " | ".join(cfgs) + " |",
             "|---|" + "---|" * len(cfgs)]
    for c in levels:
        lines.append(f"| {c} | " + " | ".join(f"{ratios[k][c]:.2f}" if c in ratios[k] else "-" for k in cfgs) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dense", required=True, help="compare.json of the dense shape")
    ap.add_argument("--moe", required=True, help="compare.json of the MoE shape")
    ap.add_argument("--out", required=True, help="PNG path (the JSON goes beside it)")
    a = ap.parse_args(argv)
    runs = {}
    for name, path in (("dense (llama-8b)", a.dense), ("MoE (qwen3-30b-a3b)", a.moe)):
        d = json.loads(Path(path).read_text())
        parts = d.get("parts", [])
        runs[name] = {"path": path, "dates": sorted({part.get("date") or "" for part in parts} - {""}),
                      "devices": sorted({(part.get("device") or "").split(",")[0] for part in parts} - {""}),
                      "over_off": over_off(d)}
        print(table(name, runs[name]["over_off"]) + "\n")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(runs, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    names = sorted({cfg for run in runs.values() for cfg in run["over_off"]})
    colour = {cfg: f"C{i}" for i, cfg in enumerate(names)}   # one colour per configuration, both panels
    for ax, (name, run) in zip(axes, runs.items()):
        for cfg, r in sorted(run["over_off"].items()):
            xs = sorted(r)
            ax.plot(xs, [r[x] for x in xs], marker="o", label=cfg, color=colour[cfg])
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name}, {' + '.join(run['devices']) or 'device unknown'}")
        ax.set_xlabel("concurrency (closed loop)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("output throughput / off")
    for ax in axes:
        ax.legend()
    fig.suptitle("Speculation over plain decoding: dense vs MoE (simulated acceptance 0.8)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
