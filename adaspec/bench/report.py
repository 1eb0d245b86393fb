"""Presenting sweeps: terminal tables, the JSON file and the PNG plot.

A *run* is the dict `adaspec.bench.sweep.run_sweep` returns (``levels`` is the list of
per-level dicts); `compare` passes several runs keyed by configuration label.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence


def simulated_banner(rate: float | None) -> str:
    """The warning every result made with a simulated acceptance rate carries ('' if none)."""
    if rate is None:
        return ""
    return (f"SIMULATED ACCEPTANCE: drafts accepted with probability {rate:g} "
            "(--spec-simulate-accept-rate), not by the draft model")


def level_label(level: Mapping) -> str:
    """Short name of a level: its concurrency (closed loop) or its request rate (open)."""
    if level.get("mode", "closed") == "closed":
        return str(level.get("concurrency"))
    rate = level.get("request_rate")
    cap = level.get("max_concurrency")
    text = f"{rate:g}" if isinstance(rate, (int, float)) else str(rate)
    return f"{text}/s" + (f" max{cap}" if cap else "")


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def sweep_table(run: Mapping, title: str = "") -> str:
    """A terminal table of one run, one row per level, under `title` and, if the server
    simulated acceptance, the simulation banner."""
    closed = all(lv.get("mode", "closed") == "closed" for lv in run["levels"])
    header = ["conc" if closed else "rate", "ok", "fail", "req/s", "out tok/s", "tot tok/s",
              "TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99", "ITL mean", "E2EL mean", "acc len"]
    rows = []
    for lv in run["levels"]:
        rows.append([level_label(lv), _fmt(lv["completed"]), _fmt(lv["failed"]),
                     _fmt(lv["request_throughput"], 2), _fmt(lv["output_throughput"]),
                     _fmt(lv["total_token_throughput"]), _fmt(lv["mean_ttft_ms"]),
                     _fmt(lv["p99_ttft_ms"]), _fmt(lv["mean_tpot_ms"], 2), _fmt(lv["p99_tpot_ms"], 2),
                     _fmt(lv["mean_itl_ms"], 2), _fmt(lv["mean_e2el_ms"]),
                     _fmt(lv.get("acceptance_length"), 2)])
    parts = [title] if title else []
    banner = simulated_banner(run.get("simulated_acceptance"))
    if banner:
        parts.append("!! " + banner)
    parts.append(_render(header, rows))
    parts.append("(latencies in ms; acc len = tokens emitted per verify step, from /metrics)")
    return "\n".join(parts)


def compare_rows(runs: Mapping[str, Mapping]) -> list[dict]:
    """Side-by-side output throughput per level: ``{"level", "throughput": {cfg: tok/s},
    "best", "ratio_to_best": {cfg: x}}``. Levels are matched by position (every run sweeps
    the same levels); a configuration without a figure (failed run) gets None."""
    ok = {k: r for k, r in runs.items() if r.get("levels")}
    if not ok:
        return []
    n = max(len(r["levels"]) for r in ok.values())
    ref = next(r for r in ok.values() if len(r["levels"]) == n)
    rows = []
    for i in range(n):
        tput = {}
        for name in runs:
            levels = runs[name].get("levels") or []
            tput[name] = levels[i].get("output_throughput") if i < len(levels) else None
        valid = {k: v for k, v in tput.items() if v is not None and v > 0}
        best = max(valid, key=valid.get) if valid else None
        ratio = {k: (v / valid[best] if best and v is not None else None) for k, v in tput.items()}
        rows.append({"level": level_label(ref["levels"][i]), "throughput": tput, "best": best,
                     "ratio_to_best": ratio})
    return rows


def compare_table(rows: Sequence[Mapping], configs: Sequence[str], title: str = "",
                  simulated: float | None = None) -> str:
    """The comparison table: output tok/s of each configuration, the best one, and each
    configuration's ratio to the best, one row per level."""
    header = ["level"] + [f"{c} tok/s" for c in configs] + ["best"] + [f"{c}/best" for c in configs]
    body = []
    for r in rows:
        body.append([r["level"]] + [_fmt(r["throughput"].get(c)) for c in configs]
                    + [r["best"] or "-"] + [_fmt(r["ratio_to_best"].get(c), 2) for c in configs])
    parts = [title] if title else []
    banner = simulated_banner(simulated)
    if banner:
        parts.append("!! " + banner)
    parts.append(_render(header, body))
    return "\n".join(parts)


def _clean(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become None (strict JSON has no NaN/Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, obj: Mapping) -> Path:
    """Write `obj` as strict, indented JSON (creating parent directories)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(obj), indent=2, allow_nan=False) + "\n")
    return path


def plot_runs(path: str | os.PathLike, runs: Mapping[str, Mapping], title: str = "",
              simulated: float | None = None) -> Path:
    """A PNG with output throughput, median TPOT and median TTFT against the sweep levels,
    one curve per run (levels on evenly spaced ticks, labelled by concurrency or rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = [("output_throughput", "output throughput (tok/s)"),
              ("median_tpot_ms", "median TPOT (ms)"), ("median_ttft_ms", "median TTFT (ms)")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels: list[str] = []
    closed = True
    for name, run in runs.items():
        levels = run.get("levels") or []
        if not levels:
            continue
        if len(levels) > len(labels):
            labels = [level_label(lv) for lv in levels]
        closed = closed and all(lv.get("mode", "closed") == "closed" for lv in levels)
        for ax, (key, _) in zip(axes, panels):
            xs = [i for i, lv in enumerate(levels) if lv.get(key) is not None]
            ax.plot(xs, [levels[i][key] for i in xs], marker="o", label=name)
    for ax, (_, ylabel) in zip(axes, panels):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels)
        ax.set_xlabel("concurrency" if closed else "request rate")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    full_title = title
    if simulated is not None:
        full_title = (title + "\n" if title else "") + f"SIMULATED acceptance rate {simulated:g}"
    if full_title:
        fig.suptitle(full_title, color="darkred" if simulated is not None else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
