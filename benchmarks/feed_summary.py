#!/usr/bin/env python3
"""Where a served run's engine time went, per server, from the policy feeds its engine processes
wrote (ADASPEC_POLICY_TRACE=PREFIX: PREFIX.<pid>.jsonl, adaspec/spec_decode/policy_trace.py).

    python3 benchmarks/feed_summary.py DIR_OR_FILES... [--json out.json]

For each feed: the policy; its steps and their summed cost (the engine's cadence, seconds);
the steps that carried prompt or catch-up rows, their share of the time, their median cost
and median rows (the prefill chunk the pacer allowed); and the decode-only steps' median cost
and tokens per request-step, by `auto`'s batch bucket and draft length; and the steps with prompt
rows by their query rows (`query_rows`) in buckets of ROWS_BUCKET, where a server's steps on either side of its
token-graph cutoff (its start-up log: "token graphs stop below N rows") show what a replay saves
over an eager step. Two configurations of one run side by side say whether one lost time in its
steps with prompt rows or in its decode steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from adaspec.spec_decode.auto_policy import AutoPolicy


def bucket(b: int) -> int:
    """`auto`'s batch bucket of b (the nearest of AutoPolicy.BUCKETS, as its cost table keys
    steps), so these rows line up with the `step_ms` a server's auto policy reports."""
    return min(AutoPolicy.BUCKETS, key=lambda x: abs(x - b))


ROWS_BUCKET = 128


def query_rows(step: list) -> int:
    """A feed line's query rows: recorded (its 8th field) since session 22; in older feeds
    estimated as the prompt (or catch-up) rows plus draft_len + 1 rows for each other request,
    exact when one request carries all the prompt rows (the pacer's usual chunk), each further
    such request counting draft_len + 1 rows too many."""
    if len(step) > 7:
        return step[7]
    batch, draft_len, _, prompt_rows = step[:4]
    return prompt_rows + max(batch - 1, 0) * (draft_len + 1)


def summarize(path: Path) -> dict:
    """The summary of one feed (see the module docstring); costs in ms."""
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    steps = [json.loads(x) for x in lines[1:] if x.strip()]
    prompt = [s for s in steps if s[3] > 0]
    decode = [s for s in steps if s[3] == 0]
    total = sum(s[2] for s in steps) / 1e3
    groups: dict[tuple[int, int], list] = {}
    for b, d, cost, _, acc, drafted, *_ in decode:
        groups.setdefault((bucket(b), d), []).append((cost / 1e3, 1.0 + sum(acc) / max(b, 1)))
    table = [{"batch": b, "draft_len": d, "steps": len(v), "median_ms": round(statistics.median(c for c, _ in v), 3),
              "tokens_per_request_step": round(statistics.fmean(t for _, t in v), 3)}
             for (b, d), v in sorted(groups.items())]
    by_rows: dict[int, list[float]] = {}
    for s in prompt:
        by_rows.setdefault(query_rows(s) // ROWS_BUCKET * ROWS_BUCKET, []).append(s[2] / 1e3)
    return {"file": path.name, **head, "steps": len(steps), "total_s": round(total / 1e3, 2),
            "prompt_steps": len(prompt),
            "prompt_share": round(sum(s[2] for s in prompt) / 1e3 / total, 3) if total else 0.0,
            "prompt_median_ms": round(statistics.median(s[2] for s in prompt) / 1e3, 2) if prompt else None,
            "prompt_median_rows": statistics.median(s[3] for s in prompt) if prompt else None,
            "decode": table,
            "prompt_by_rows": [{"rows_from": r, "steps": len(v), "median_ms": round(statistics.median(v), 2)}
                               for r, v in sorted(by_rows.items())]}


def feeds(args: list[str]) -> list[Path]:
    out = []
    for a in args:
        p = Path(a)
        out += sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="feeds (PREFIX.<pid>.jsonl) or directories holding them")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [summarize(p) for p in feeds(a.paths)]
    for r in rows:
        print(f"== {r['file']}: {r['policy']} (num_steps {r['num_steps']}, topk {r['topk']}): {r['steps']} steps, "
              f"{r['total_s']} s; with prompt rows {r['prompt_steps']} steps, {100 * r['prompt_share']:.1f}% of the "
              f"time, median {r['prompt_median_ms']} ms and {r['prompt_median_rows']} rows")
        for t in r["decode"]:
            print(f"   bucket {t['batch']:>4} draft {t['draft_len']:>2}: {t['steps']:>6} steps, median {t['median_ms']:.3f} ms, "
                  f"{t['tokens_per_request_step']:.2f} tokens per request-step")
        if r["prompt_by_rows"]:
            print("   steps with prompt rows by query rows (from: median ms, steps): " + ", ".join(
                f"{t['rows_from']}: {t['median_ms']:.1f} ({t['steps']})" for t in r["prompt_by_rows"]))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
