"""The `auto` policy's cost table (spec_decode/auto_policy.py: AutoPolicy.times), the windows
of measured step times behind its entries, and the line that prices the prompt rows a step
carries (`fixed_and_per_row`: the policy's catch-up price, the engine's prefill pacer)."""
from __future__ import annotations

import bisect
from collections import deque


class CostWindow:
    """The last `size` step times of one cost-table entry, also kept in order (a quantile is
    read at every step the entry is sampled; sorting per step is host time at batch 1)."""

    __slots__ = ("recent", "order")

    def __init__(self, size: int):
        self.recent: deque = deque(maxlen=size)
        self.order: list[float] = []

    def add(self, t: float) -> None:
        if len(self.recent) == self.recent.maxlen:
            del self.order[bisect.bisect_left(self.order, self.recent[0])]
        self.recent.append(t)
        bisect.insort(self.order, t)

    def quantile(self, q: float) -> float:
        """The q-quantile of the window (0: its fastest step), by rank, no interpolation."""
        return self.order[int(q * (len(self.order) - 1))]


def fixed_and_per_row(samples) -> tuple[float, float]:
    """(fixed seconds, seconds per row) that prompt or catch-up rows add to a step, from
    (rows, seconds added) samples: a least-squares line where the row counts differ twofold
    or more, its slope within [0, largest added / fewest rows] and its intercept at least 0;
    else per row alone (the median of seconds / rows). Why a fixed part: a step that carries
    any prompt rows pays for them beyond their count (it runs eagerly, and on a mixture of
    experts a few rows already read most experts: on the Qwen3-30B-A3B shape served on the H200,
    58 ms fixed and 6.7 us a row, so 64 rows cost about what 512 do). No samples: (0, 0)."""
    samples = list(samples)
    if not samples:
        return 0.0, 0.0
    rows = [n for n, _ in samples]
    extra = [t for _, t in samples]
    fit = (0.0, sorted(t / n for n, t in samples)[len(rows) // 2])
    if len(rows) >= 2 and max(rows) >= 2 * min(rows):
        mn, mt = sum(rows) / len(rows), sum(extra) / len(extra)
        var = sum((n - mn) ** 2 for n in rows)
        slope = sum((n - mn) * (t - mt) for n, t in zip(rows, extra)) / var
        slope = min(max(slope, 0.0), max(extra) / min(rows))
        fit = (max(0.0, mt - slope * mn), slope)
    return fit


class CostTable(dict):
    """AutoPolicy's cost table, (depth, batch bucket) -> seconds, which keeps each depth's
    points sorted by batch size for `step_time` (called for every depth of every decision)
    until an entry changes."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._points: dict[int, list] | None = None
        self.version = 0   # bumped by every change (callers cache what they derive from the table)

    def __setattr__(self, name, value):
        if name == "_points" and value is None:
            self.__dict__["version"] = self.__dict__.get("version", 0) + 1
        super().__setattr__(name, value)

    def __setitem__(self, key, value):
        if self.get(key) != value:
            super().__setitem__(key, value)
            self._points = None

    def __delitem__(self, key):
        super().__delitem__(key)
        self._points = None

    def pop(self, *a):
        self._points = None
        return super().pop(*a)

    def clear(self):
        super().clear()
        self._points = None

    def update(self, *a, **kw):
        super().update(*a, **kw)
        self._points = None

    def setdefault(self, key, default=None):
        self._points = None
        return super().setdefault(key, default)

    def popitem(self):
        self._points = None
        return super().popitem()

    def points(self, depth: int, buckets: tuple) -> list[tuple[int, float]]:
        """[(batch size, seconds)] of `depth`, ascending."""
        if self._points is None:
            pts: dict[int, list] = {}
            for (d, k), t in self.items():
                pts.setdefault(d, []).append((buckets[k], t))
            for v in pts.values():
                v.sort()
            self._points = pts
        return self._points.get(depth, [])
