"""Measured launches of the paged-attention kernel, per head layout, query length and batch.

`attention_configs.json` (next to this file, written by benchmarks/kernels/attention_sweep.py
--table-out) holds, per key "G{query heads per KV head}_D{head dim}", per query length "q{n}"
and per measured batch size, the fastest launch the sweep found:

    {"G8_D128": {"q1": {"1": {"block_q": 1, "block_n": 64, "num_warps": 4, "num_stages": 3,
                               "num_splits": 1, "us": 7.1}, "256": {...}}, "q4": {...}}}

`lookup` returns the entry for the measured batch nearest (in log scale) to the asked one and
the smallest measured query length that covers it; None where the table has nothing for the
layout (the heuristics in triton_kernels.py apply). The sweep measures bf16; the kernel takes the
key block, warps, stages and splits for 2-byte inputs only. The table only chooses among launches that
are all correct: block_q (rows per program), key block, warps, stages and the split-KV factor
change the time and, within bf16 rounding of the split merge, nothing else.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

TABLE_FILE = Path(__file__).with_name("attention_configs.json")
FIELDS = ("block_q", "block_n", "num_warps", "num_stages", "num_splits")


@lru_cache(maxsize=None)
def _table(path: str) -> dict:
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else {}


def clear_cache() -> None:
    """Forget the tables read and the lookups made (after a table file changed)."""
    _table.cache_clear()
    _lookup.cache_clear()


def lookup(group: int, head_dim: int | None, max_q_len: int, num_reqs: int,
           path: Path | None = None) -> Mapping[str, int] | None:
    """The measured launch (a read-only mapping of FIELDS) for `num_reqs` requests of up to
    `max_q_len` query rows, at `group` query heads per KV head and `head_dim` (None: the
    layout's only measured head dim, for callers that know the group alone, e.g. choosing
    block_q); or None. Memoized: every eager attention launch asks (twice, with its block_q)."""
    return _lookup(group, head_dim, max_q_len, num_reqs, str(path or TABLE_FILE))


@lru_cache(maxsize=4096)
def _lookup(group: int, head_dim: int | None, max_q_len: int, num_reqs: int, path: str):
    table = _table(path)
    if head_dim is None:
        keys = [k for k in table if k.startswith(f"G{group}_D")]
        layout = table[keys[0]] if len(keys) == 1 else None
    else:
        layout = table.get(f"G{group}_D{head_dim}")
    if not layout or max_q_len < 1 or num_reqs < 1:
        return None
    qs = sorted(int(k[1:]) for k in layout)
    q = next((v for v in qs if v >= max_q_len), None)
    if q is None:   # longer than anything measured (prefill chunks): the heuristics
        return None
    by_batch = layout[f"q{q}"]
    b = min((int(k) for k in by_batch), key=lambda v: (abs(math.log2(v) - math.log2(num_reqs)), v))
    entry = by_batch[str(b)]
    return MappingProxyType({f: int(entry[f]) for f in FIELDS})


def entries(group: int, head_dim: int, path: Path | None = None) -> list[dict]:
    """Every measured launch of the layout (what a warm-up compiles before serving)."""
    layout = _table(str(path or TABLE_FILE)).get(f"G{group}_D{head_dim}", {})
    return [{f: int(e[f]) for f in FIELDS} for by_batch in layout.values() for e in by_batch.values()]


def merge_entry(table: dict, group: int, head_dim: int, q: int, batch: int, launch: dict) -> dict:
    """`table` with the launch of (q, batch) set (the sweep's writer; returns the same dict)."""
    table.setdefault(f"G{group}_D{head_dim}", {}).setdefault(f"q{q}", {})[str(batch)] = dict(launch)
    return table
