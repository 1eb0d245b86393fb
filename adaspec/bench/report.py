"""Presenting sweeps: terminal tables, the JSON file and the PNG plot.

A *run* is the dict `adaspec.bench.sweep.run_sweep` returns (``levels`` is the list of
per-level dicts); `compare` passes several runs keyed by configuration label.
"""
from __future__ import annotations

import json
import math
import os
import statistics
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


#: `sweep_table`'s columns after the level's own: (header, level field, digits). Every level
#: has each field but the acceptance length (runs without speculation metrics lack it).
SWEEP_COLUMNS = (("ok", "completed", 1), ("fail", "failed", 1), ("req/s", "request_throughput", 2),
                 ("out tok/s", "output_throughput", 1), ("tot tok/s", "total_token_throughput", 1),
                 ("TTFT p50", "median_ttft_ms", 1), ("TTFT p99", "p99_ttft_ms", 1),
                 ("TPOT p50", "median_tpot_ms", 2), ("TPOT p99", "p99_tpot_ms", 2),
                 ("ITL mean", "mean_itl_ms", 2), ("E2EL mean", "mean_e2el_ms", 1),
                 ("acc len", "acceptance_length", 2))


def sweep_table(run: Mapping, title: str = "") -> str:
    """A terminal table of one run, one row per level, under `title` and, if the server
    simulated acceptance, the simulation banner."""
    closed = all(lv.get("mode", "closed") == "closed" for lv in run["levels"])
    header = ["conc" if closed else "rate"] + [h for h, _, _ in SWEEP_COLUMNS]
    rows = [[level_label(lv)] + [_fmt(lv.get(f) if f == "acceptance_length" else lv[f], d)
                                 for _, f, d in SWEEP_COLUMNS] for lv in run["levels"]]
    parts = [title] if title else []
    banner = simulated_banner(run.get("simulated_acceptance"))
    if banner:
        parts.append("!! " + banner)
    parts.append(_render(header, rows))
    parts.append("(latencies in ms; acc len = tokens emitted per verify step, from /metrics)")
    return "\n".join(parts)


#: Per-configuration figures `compare_rows` puts beside the throughput of each level.
ROW_FIELDS = ("median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms", "acceptance_length")


def level_order(runs: Mapping[str, Mapping]) -> list[tuple[str, Mapping]]:
    """The levels of all runs, matched by label: (label, a level dict carrying it), closed-loop
    levels by increasing concurrency, otherwise in order of first appearance. Runs may sweep
    different levels (a failed run, results merged from several partial runs)."""
    seen: dict[str, Mapping] = {}
    for run in runs.values():
        for lv in run.get("levels") or []:
            seen.setdefault(level_label(lv), lv)
    items = list(seen.items())
    if items and all(lv.get("mode", "closed") == "closed" and isinstance(lv.get("concurrency"), int)
                     for _, lv in items):
        items.sort(key=lambda kv: kv[1]["concurrency"])
    return items


def compare_rows(runs: Mapping[str, Mapping]) -> list[dict]:
    """One dict per level: ``{"level", "concurrency", "throughput": {cfg: tok/s}, "best",
    "ratio_to_best": {cfg: x}}`` plus, for each field of `ROW_FIELDS` (p50/p99 TPOT and
    TTFT, acceptance length), ``{cfg: value}``. Levels are matched by label; a configuration
    without that level (failed run, partial sweep) gets None."""
    rows = []
    for label, ref in level_order(runs):
        by_cfg = {name: next((lv for lv in run.get("levels") or [] if level_label(lv) == label), None)
                  for name, run in runs.items()}
        tput = {k: (lv or {}).get("output_throughput") for k, lv in by_cfg.items()}
        valid = {k: v for k, v in tput.items() if v is not None and v > 0}
        best = max(valid, key=valid.get) if valid else None
        ratio = {k: (v / valid[best] if best and v is not None else None) for k, v in tput.items()}
        row = {"level": label, "concurrency": ref.get("concurrency") if ref.get("mode", "closed") == "closed" else None,
               "throughput": tput, "best": best, "ratio_to_best": ratio}
        for f in ROW_FIELDS:
            row[f] = {k: (lv or {}).get(f) for k, lv in by_cfg.items()}
        rows.append(row)
    return rows


def compare_table(rows: Sequence[Mapping], configs: Sequence[str], title: str = "",
                  simulated: float | None = None) -> str:
    """The comparison: output tok/s of each configuration, the best one and each one's ratio
    to the best, one row per level; then one row per level and configuration with its p50 and
    p99 TPOT and TTFT (ms) and acceptance length."""
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
    parts.append("")
    parts.append(latency_table(rows, configs))
    return "\n".join(parts)


def rounds_summary(rounds: Sequence[Mapping[str, Mapping]], configs: Sequence[str]) -> list[dict]:
    """Over several rounds of the same configurations (`compare --rounds`): one dict per level,
    ``{"level", "throughput": {cfg: [tok/s per round]}, "median": {cfg: tok/s}, "ratio":
    {cfg: [tok/s over the first configuration's, per round]}, "median_ratio": {cfg: x}}``.
    A ratio pairs figures of one round (servers started one after the other), so a host that
    is faster in one round than the next moves both sides; a round without a figure is left out."""
    per_round = [{r["level"]: r["throughput"] for r in compare_rows(runs)} for runs in rounds]
    levels = list(dict.fromkeys(level for rows in per_round for level in rows))
    ref = configs[0]
    out = []
    for level in levels:
        tput = {c: [rows.get(level, {}).get(c) for rows in per_round] for c in configs}
        ratio = {c: [t / r if t and r else None for t, r in zip(tput[c], tput[ref])] for c in configs}
        out.append({"level": level, "throughput": tput, "ratio": ratio,
                    "median": {c: _median([v for v in tput[c] if v]) for c in configs},
                    "median_ratio": {c: _median([v for v in ratio[c] if v]) for c in configs}})
    return out


def rounds_table(summary: Sequence[Mapping], configs: Sequence[str]) -> str:
    """`rounds_summary` as text: per level and configuration, the median tok/s, and its ratio
    to the first configuration in each round and their median."""
    ref = configs[0]
    header = ["level", "config", "median tok/s", f"x {ref} per round", f"median x {ref}"]
    body = [[r["level"], c, _fmt(r["median"][c]), " ".join(_fmt(v, 2) for v in r["ratio"][c]),
             _fmt(r["median_ratio"][c], 2)] for r in summary for c in configs]
    return _render(header, body)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def latency_table(rows: Sequence[Mapping], configs: Sequence[str]) -> str:
    """One row per level and configuration: tok/s, ratio to the level's best, p50/p99 TPOT
    and TTFT in ms, acceptance length."""
    header = ["level", "config", "out tok/s", "x best", "TPOT p50", "TPOT p99", "TTFT p50",
              "TTFT p99", "acc len"]
    body = []
    for r in rows:
        for c in configs:
            g = lambda f: r.get(f, {}).get(c)  # noqa: E731
            body.append([r["level"], c, _fmt(r["throughput"].get(c)), _fmt(r["ratio_to_best"].get(c), 2),
                         _fmt(g("median_tpot_ms"), 2), _fmt(g("p99_tpot_ms"), 2),
                         _fmt(g("median_ttft_ms")), _fmt(g("p99_ttft_ms")),
                         _fmt(g("acceptance_length"), 2)])
    return _render(header, body) + "\n(latencies in ms)"


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
    """Write `obj` as strict, indented JSON (creating parent directories). The file is
    replaced whole (written beside it, then renamed), so a process killed while writing leaves
    the previous version, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


PLOT_PANELS = (("output_throughput", None, "output throughput (tok/s); n = requests per point"),
               ("median_tpot_ms", "p99_tpot_ms", "TPOT (ms): p50 solid, p99 dashed"),
               ("median_ttft_ms", "p99_ttft_ms", "TTFT (ms, log): p50 solid, p99 dashed"))


def make_figure(runs: Mapping[str, Mapping], title: str = "", simulated: float | None = None):
    """The figure `plot_runs` saves: output throughput (each point labelled with its number of
    completed requests), TPOT, TTFT on a log scale, and speculation (acceptance length solid,
    the mean draft length the policy chose dotted, from the server's /metrics), against the
    levels, one colour per run, p50 solid and p99 dashed. Closed-loop sweeps put concurrency
    on a log2 axis; open-loop ones put the rates on evenly spaced ticks."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = level_order(runs)
    closed = bool(order) and all(lv.get("mode", "closed") == "closed" and isinstance(lv.get("concurrency"), int)
                                 for _, lv in order)
    pos = {label: (lv["concurrency"] if closed else i) for i, (label, lv) in enumerate(order)}
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (name, run) in enumerate(runs.items()):
        levels = run.get("levels") or []
        color = colors[n % len(colors)]
        for ax, (key, p99, _) in zip(axes, PLOT_PANELS):
            for field, style, lab in ((key, "-", name), (p99, "--", None)):
                if field is None:
                    continue
                pts = sorted((pos[level_label(lv)], lv[field]) for lv in levels
                             if lv.get(field) is not None and level_label(lv) in pos)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o" if style == "-" else ".",
                            color=color, label=lab, alpha=1.0 if style == "-" else 0.6)
        for lv in levels:   # requests per point, on the throughput panel
            if lv.get("output_throughput") is not None and level_label(lv) in pos:
                axes[0].annotate(f"n={lv.get('completed', lv.get('num_requests', '?'))}",
                                 (pos[level_label(lv)], lv["output_throughput"]), fontsize=7, color=color,
                                 textcoords="offset points", xytext=(0, 5), ha="center")
        for field, style in (("acceptance_length", "-"), ("mean_draft_len", ":")):
            pts = sorted((pos[level_label(lv)], lv[field]) for lv in levels
                         if lv.get(field) is not None and level_label(lv) in pos)
            if pts:
                axes[3].plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", color=color,
                             label=f"{name}: {'acceptance length' if style == '-' else 'draft length chosen'}")
    ticks = [pos[label] for label, _ in order]
    panel_labels = [label for _, _, label in PLOT_PANELS] + ["speculation: acceptance length (solid), draft length chosen (dotted)"]
    for ax, ylabel in zip(axes, panel_labels):
        if closed:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels([label for label, _ in order])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (closed loop)" if closed else "request rate")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if "log" in ylabel:   # TTFT spans orders of magnitude from concurrency 1 to 256
            if ax.lines:
                ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
    for ax in (axes[0], axes[3]):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    full_title = title
    if simulated is not None:
        full_title = (title + "\n" if title else "") + f"SIMULATED acceptance rate {simulated:g}"
    if full_title:
        fig.suptitle(full_title, color="darkred" if simulated is not None else "black")
    fig.tight_layout()
    return fig


def plot_runs(path: str | os.PathLike, runs: Mapping[str, Mapping], title: str = "",
              simulated: float | None = None) -> Path:
    """Write `make_figure`'s PNG to `path` (creating parent directories)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = make_figure(runs, title, simulated)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
