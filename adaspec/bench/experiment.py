"""The load experiment (`benchmarks/load_experiment.py`): its plan, the merge of partial runs,
the ratios it reports and its README.

A run is split into *parts* (each a directory holding one `adaspec compare` result,
``compare.json``, plus ``part.json``: the command, device, date and the offline references
measured in that part). `merge_parts` combines parts into one result; `experiment_ratios`
computes the figures the experiment asks for from it; `render_readme` writes them up.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from adaspec.bench.report import compare_rows, level_label, simulated_banner

#: Closed-loop concurrency levels of the full experiment.
LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: The draft shapes of the fixed configurations.
CHAIN3 = "--num-steps 3 --topk 1"
TREE16 = "--num-steps 2 --topk 4 --num-draft-tokens 16"
#: `auto` gets chains of 0..4 draft tokens: AutoPolicy's candidates are the depth-capped
#: prefixes of the one configured shape (policy.py), so a chain config lets it pick the
#: chain length; a tree config would let it pick only the depth of that tree.
AUTO_FLAGS = "--num-steps 4 --topk 1"
#: What each role of the experiment is called in its --configs (see `default_configs`).
DEFAULT_ROLES = {"off": "off", "chain3": "chain3", "tree16": "tree16", "threshold": "thr32",
                 "auto": "auto", "idle": "idle"}
LLM_GENERATE_TARGET = 0.85   # server tok/s at the highest level / LLM.generate tok/s, same requests
HF_KEY = "paged|sdpa:{n}"    # hf_cb_probe.py's result key for n requests


#: The draft loaded (and its KV kept up to date) but never used: every request opts out of
#: speculation. threshold:1 is not that: it speculates while a single request runs and stops
#: for good only after the first step with two (resume at <= N - max(1, N // 4) = 0), so an
#: idle run would depend on the warm-up's two requests overlapping.
IDLE_REQUEST = '{"speculate": false}'


def default_configs(threshold: int = 32, auto_flags: str = AUTO_FLAGS) -> str:
    """The experiment's `--configs`: off; always with a chain of 3 and with the 16-token tree;
    threshold:N (chain 3 while at most N requests run); auto; and `idle`, the draft loaded
    but unused (`IDLE_REQUEST`). The result checks the last: `idle_verify_steps` must be 0."""
    return (f"off,chain3=always[{CHAIN3}],tree16=always[{TREE16}],"
            f"thr{threshold}=threshold:{threshold}[{CHAIN3}],auto=auto[{auto_flags}],"
            f"idle=always[{CHAIN3} --request-json '{IDLE_REQUEST}']")


def roles_for(threshold: int = 32) -> dict[str, str]:
    return {**DEFAULT_ROLES, "threshold": f"thr{threshold}"}


def prompts_per_level(levels: Sequence[int], waves: float = 2.0, min_prompts: int = 8) -> list[int]:
    """Requests per closed-loop level: `waves` times the concurrency (every slot refilled
    waves-1 times), at least `min_prompts` so low levels have a few latency samples."""
    return [max(int(math.ceil(waves * c)), min_prompts) for c in levels]


def prompt_starts(levels: Sequence[int], counts: Sequence[int], num_warmup: int,
                  ladder: Sequence[int] = LEVELS, waves: float = 2.0, min_prompts: int = 8) -> list[int]:
    """Dataset index of each level's first request, laid out over the full ladder (plus any
    extra level), so a part that sweeps some levels sends the same requests per level as a
    run of all of them. `counts` must be `prompts_per_level` of `levels`."""
    full = sorted(set(ladder) | set(levels))
    full_counts = prompts_per_level(full, waves, min_prompts)
    start, starts = num_warmup, {}
    for c, n in zip(full, full_counts):
        starts[c] = start
        start += n
    for c, n in zip(levels, counts):
        if n != full_counts[full.index(c)]:
            raise ValueError(f"level {c}: {n} prompts, expected {full_counts[full.index(c)]}")
    return [starts[c] for c in levels]


# ----------------------------------------------------------------------------- merge

def load_part(path: str | Path) -> dict:
    """A part directory (or its compare.json): the compare result with the part's
    ``part.json`` under the key "part" (empty when absent)."""
    path = Path(path)
    d = path if path.is_dir() else path.parent
    res = json.loads((d / "compare.json").read_text())
    meta = d / "part.json"
    res["part"] = json.loads(meta.read_text()) if meta.exists() else {}
    res["part"].setdefault("dir", str(d))
    return res


def merge_parts(parts: Sequence[Mapping], order: Sequence[str] | None = None) -> dict:
    """One result from several parts. Configurations are united (in `order`, then in order of
    appearance); a configuration found in several parts has its levels united by level,
    a later part's level replacing an earlier one's (noted in ``merge_notes``); an earlier part's
    error stays unless a later part, without error, ran that configuration at every level the
    earlier one reached (a rerun) or at every level of the earlier part's plan it did not reach (a
    continuation); a cleared error is noted. The offline references (``llm_generate``,
    ``hf_cb``) are taken from whichever part has them."""
    configs: dict[str, dict] = {}
    notes: list[str] = []
    reference: dict = {}
    meta = []
    simulated = set()
    for i, part in enumerate(parts):
        pm = dict(part.get("part") or {})
        meta.append({k: pm.get(k) for k in ("name", "dir", "command", "compare_command", "device",
                                            "date", "configs", "levels", "duration_s")}
                    | {"compare_date": part.get("date")})
        if part.get("simulated_acceptance") is not None:
            simulated.add(part["simulated_acceptance"])
        for key in ("llm_generate", "hf_cb"):
            new = pm.get(key)
            if new is None:
                continue
            old = reference.get(key)
            if old is not None:   # keep the reference of the highest level
                if (new.get("level") or 0) < (old.get("level") or 0):
                    notes.append(f"{key}: kept the earlier part's (higher level)")
                    continue
                notes.append(f"{key}: part {pm.get('name', i)} replaces an earlier part's")
            reference[key] = new
        for label, entry in (part.get("configs") or {}).items():
            entry = {**entry, "part": pm.get("name", i), "planned": [str(c) for c in pm.get("levels") or []]}
            if label not in configs:
                configs[label] = entry
                continue
            old = configs[label]
            levels = {level_label(lv): lv for lv in old.get("levels") or []}
            for lv in entry.get("levels") or []:
                if level_label(lv) in levels:
                    notes.append(f"{label} level {level_label(lv)}: part {pm.get('name', i)} replaces "
                                 f"part {old.get('part')}")
                levels[level_label(lv)] = lv
            merged = {**old, "levels": sorted(levels.values(), key=_level_key)}
            # A later run without error supersedes an earlier error if it ran every level the
            # earlier run reached (a part cut short, run again in full) or every planned level
            # the earlier run did not reach (a part cut short, then finished).
            reached = {level_label(lv) for lv in old.get("levels") or []}
            ran = {level_label(lv) for lv in entry.get("levels") or []}
            planned = set(old.get("planned") or ())   # (none in parts without a part.json)
            redone = not entry.get("error") and (reached <= ran or bool(planned) and planned - reached <= ran)
            if redone and old.get("error"):
                notes.append(f"{label}: part {pm.get('name', i)} clears part {old.get('part')}'s error "
                             f"({old['error']})")
            errors = (entry.get("error"),) if redone else (old.get("error"), entry.get("error"))
            merged["error"] = "; ".join(e for e in errors if e) or None
            merged["parts"] = [*old.get("parts", [old.get("part")]), entry["part"]]
            merged["planned"] = sorted(planned | set(entry["planned"]), key=str)
            configs[label] = merged
    if order:
        known = [k for k in order if k in configs]
        configs = {k: configs[k] for k in known + [k for k in configs if k not in known]}
    first = parts[0] if parts else {}
    return {"tool": "benchmarks/load_experiment.py", "dataset": first.get("dataset"),
            "simulated_acceptance": next(iter(simulated)) if len(simulated) == 1 else None,
            "simulated_acceptance_note": (simulated_banner(next(iter(simulated)))
                                          if len(simulated) == 1 else None),
            "parts": meta, "merge_notes": notes, "configs": configs,
            "comparison": compare_rows(configs), "reference": reference}


def _level_key(lv: Mapping):
    c = lv.get("concurrency")
    return (0, c) if isinstance(c, int) else (1, str(lv.get("request_rate")))


# ----------------------------------------------------------------------------- ratios

def throughput(result: Mapping, label: str | None, concurrency: int) -> float | None:
    """Output tok/s of configuration `label` at closed-loop `concurrency` (None if absent)."""
    if label is None:
        return None
    for lv in (result.get("configs", {}).get(label) or {}).get("levels") or []:
        if lv.get("mode", "closed") == "closed" and lv.get("concurrency") == concurrency:
            v = lv.get("output_throughput")
            return v if isinstance(v, (int, float)) and v > 0 else None
    return None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def experiment_ratios(result: Mapping, roles: Mapping[str, str] | None = None, *,
                      high: int = 256, low: int = 1, auto_off_at: Sequence[int] = (128, 256),
                      idle_at: Sequence[int] = (64, 256)) -> dict:
    """The figures the load experiment reports, from a (merged) compare result. `roles` maps
    off/chain3/tree16/threshold/auto/idle to configuration labels. Fixed configurations are
    those whose policy is off or always. A ratio whose figures are missing is None."""
    roles = {**DEFAULT_ROLES, **(roles or {})}
    cfgs = result.get("configs", {})
    R = {k: (v if v in cfgs else None) for k, v in roles.items()}
    levels = sorted({lv["concurrency"] for e in cfgs.values() for lv in e.get("levels") or []
                     if lv.get("mode", "closed") == "closed" and isinstance(lv.get("concurrency"), int)})
    fixed = [k for k, e in cfgs.items() if e.get("policy") in ("off", "always")]
    T = lambda role, c: throughput(result, R.get(role), c)  # noqa: E731
    out: dict = {"roles": R, "fixed_configs": fixed, "levels": levels}
    out["off_over_tree16"] = {"level": high, "ratio": _div(T("off", high), T("tree16", high))}
    out["chain3_over_off"] = {"level": low, "ratio": _div(T("chain3", low), T("off", low))}
    best_fixed, auto_best, auto_tree = {}, {}, {}
    for c in levels:
        vals = {k: throughput(result, k, c) for k in fixed}
        vals = {k: v for k, v in vals.items() if v is not None}
        if not vals:
            continue
        b = max(vals, key=vals.get)
        best_fixed[c] = b
        auto_best[c] = {"best_fixed": b, "ratio": _div(T("auto", c), vals[b])}
        if R["tree16"] is not None and b != R["tree16"]:
            auto_tree[c] = _div(T("auto", c), T("tree16", c))
    out["best_fixed"] = best_fixed
    out["auto_over_best_fixed"] = auto_best
    out["auto_over_off"] = {c: _div(T("auto", c), T("off", c)) for c in auto_off_at}
    out["auto_over_tree16_where_tree_not_best"] = auto_tree
    out["idle_over_off"] = {c: _div(T("idle", c), T("off", c)) for c in idle_at}
    # Where a chain of 3 stops paying: the first level at which it is slower than off.
    stops = [c for c in levels if T("chain3", c) is not None and T("off", c) is not None
             and T("chain3", c) < T("off", c)]
    out["chain3_stops_paying_at"] = stops[0] if stops else None
    idle_steps = [lv.get("spec_verify_steps") for lv in (cfgs.get(R["idle"]) or {}).get("levels") or []] \
        if R["idle"] else []
    out["idle_verify_steps"] = (sum(s for s in idle_steps if s is not None)
                                if any(s is not None for s in idle_steps) else None)
    ref = result.get("reference") or {}
    llm = ref.get("llm_generate") or {}
    if llm.get("level") not in (None, high):   # a reference of another level's requests
        llm = {}
    ratio = _div(T("off", high), llm.get("output_tok_s"))
    out["server_over_llm_generate"] = {"level": high, "ratio": ratio, "target": LLM_GENERATE_TARGET,
                                       "met": None if ratio is None else ratio >= LLM_GENERATE_TARGET,
                                       "llm_generate_tok_s": llm.get("output_tok_s")}
    hf = (ref.get("hf_cb") or {}).get(HF_KEY.format(n=high))
    hf = hf if isinstance(hf, (int, float)) else None
    out["server_over_hf_cb"] = {"level": high, "ratio": _div(T("off", high), hf), "hf_cb_tok_s": hf}
    return out


# ----------------------------------------------------------------------------- README

def _f(v, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render_readme(result: Mapping, ratios: Mapping, *, title: str, setup: Sequence[str],
                  merge_command: str | None = None) -> str:
    """The README of a (merged) load experiment: setup, commands, device, tables, ratios."""
    cfgs = result.get("configs", {})
    names = list(cfgs)
    rows = result.get("comparison") or []
    out = [f"# {title}", ""]
    if result.get("simulated_acceptance_note"):
        out += [f"**{result['simulated_acceptance_note']}.** The cost side (every forward, "
                "the draft, verification, the server) is real; the acceptance is not.", ""]
    out += [f"- {s}" for s in setup] + [""]
    out += ["## Commands, device, date", ""]
    for p in result.get("parts") or []:
        out += [f"Part `{p.get('name')}` ({_f(p.get('duration_s'), 0)} s): configs "
                f"{', '.join(p.get('configs') or []) or '-'}; levels "
                f"{', '.join(map(str, p.get('levels') or [])) or '-'}",
                f"- device: {p.get('device') or '-'}", f"- date: {p.get('date') or p.get('compare_date') or '-'}",
                "", "```bash", p.get("command") or "-", "```", ""]
        if p.get("compare_command"):
            out += ["which ran", "", "```bash", p["compare_command"], "```", ""]
    if merge_command:
        out += ["Merged with", "", "```bash", merge_command, "```", ""]
    out += ["Server command of each configuration (the port varies):", ""]
    for name, e in cfgs.items():
        cmd = " ".join(e.get("server_command") or [])
        cmd = cmd[cmd.find("serve"):] if "serve" in cmd else cmd
        out.append(f"- `{name}`: `{cmd}`" + (f" **error: {e['error']}**" if e.get("error") else ""))
    out.append("")

    out += ["## Output throughput (tok/s)", ""]
    out.append(_table(["concurrency"] + names + ["best"],
                      ([r["level"]] + [_f(r["throughput"].get(n)) for n in names] + [r["best"] or "-"]
                       for r in rows)))
    for key, what in (("tpot", "TPOT"), ("ttft", "TTFT")):
        out += ["", f"## {what} p50 / p99 (ms)", ""]
        digits = 2 if key == "tpot" else 1
        out.append(_table(["concurrency"] + names, (
            [r["level"]] + [f"{_f(r[f'median_{key}_ms'].get(n), digits)} / {_f(r[f'p99_{key}_ms'].get(n), digits)}"
                            for n in names] for r in rows)))
    out += ["", "## Acceptance length (tokens per verify step, from /metrics)", ""]
    out.append(_table(["concurrency"] + names,
                      ([r["level"]] + [_f(r["acceptance_length"].get(n), 2) for n in names] for r in rows)))
    out += ["", "## Ratios", ""]
    out += ratio_lines(ratios)
    if result.get("merge_notes"):
        out += ["", "Merge notes: " + "; ".join(result["merge_notes"])]
    return "\n".join(out) + "\n"


def ratio_lines(r: Mapping) -> list[str]:
    """The ratios as Markdown bullet lines."""
    R = r.get("roles", {})
    lines = []
    o = r["off_over_tree16"]
    lines.append(f"- off / tree16 at {o['level']}: **{_f(o['ratio'], 2)}**")
    o = r["chain3_over_off"]
    lines.append(f"- chain3 / off at {o['level']}: **{_f(o['ratio'], 2)}**")
    lines.append(f"- chain 3 stops paying (first level where chain3 < off): "
                 f"**{_f(r.get('chain3_stops_paying_at'))}** (threshold config: `{R.get('threshold') or '-'}`)")
    cells = ", ".join(f"{c}: {_f(v['ratio'], 2)} ({v['best_fixed']})" for c, v in r["auto_over_best_fixed"].items())
    lines.append(f"- auto / best fixed config ({', '.join(r.get('fixed_configs') or [])}), per level "
                 f"(best fixed in brackets): {cells or '-'}")
    lines.append("- auto / off: " + (", ".join(f"at {c}: **{_f(v, 2)}**" for c, v in r["auto_over_off"].items()) or "-"))
    cells = ", ".join(f"{c}: {_f(v, 2)}" for c, v in r["auto_over_tree16_where_tree_not_best"].items())
    lines.append(f"- auto / tree16 where tree16 is not the best fixed config: {cells or '-'}")
    lines.append("- idle (draft loaded, unused) / off: "
                 + (", ".join(f"at {c}: **{_f(v, 3)}**" for c, v in r["idle_over_off"].items()) or "-")
                 + f"; verify steps of idle over all its levels: {_f(r.get('idle_verify_steps'))} (must be 0)")
    o = r["server_over_llm_generate"]
    met = {True: "met", False: "**missed**", None: "-"}[o["met"]]
    lines.append(f"- server (off) at {o['level']} / `LLM.generate` on the same requests "
                 f"({_f(o.get('llm_generate_tok_s'))} tok/s): **{_f(o['ratio'], 2)}** "
                 f"(target >= {o['target']}: {met})")
    o = r["server_over_hf_cb"]
    lines.append(f"- server (off) at {o['level']} / transformers continuous batching "
                 f"({_f(o.get('hf_cb_tok_s'))} tok/s, its probe's own 128-token prompts): "
                 f"{_f(o['ratio'], 2)}")
    return lines
