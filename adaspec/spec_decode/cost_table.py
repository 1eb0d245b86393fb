"""The `auto` policy's cost table (spec_decode/auto_policy.py: AutoPolicy.times) and the
windows of measured step times behind its entries."""
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
