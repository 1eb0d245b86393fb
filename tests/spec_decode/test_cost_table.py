"""spec_decode/cost_table.py: the cost table's sorted points follow every way it changes."""
from adaspec.spec_decode.cost_table import CostTable

BUCKETS = (1, 2, 4, 8)


def test_points_sorted_per_depth_and_follow_changes():
    t = CostTable()
    t[(1, 2)] = 0.3
    t[(1, 0)] = 0.1
    t[(0, 3)] = 0.5
    assert t.points(1, BUCKETS) == [(1, 0.1), (4, 0.3)] and t.points(0, BUCKETS) == [(8, 0.5)]
    assert t.points(2, BUCKETS) == []
    t[(1, 1)] = 0.2                                   # a new entry
    assert t.points(1, BUCKETS) == [(1, 0.1), (2, 0.2), (4, 0.3)]
    t[(1, 1)] = 0.25                                  # a changed one
    assert t.points(1, BUCKETS)[1] == (2, 0.25)
    del t[(1, 0)]
    assert t.points(1, BUCKETS)[0] == (2, 0.25)
    assert t.pop((1, 2)) == 0.3 and t.points(1, BUCKETS) == [(2, 0.25)]
    t.update({(1, 3): 0.9})
    assert t.points(1, BUCKETS) == [(2, 0.25), (8, 0.9)]
    t.setdefault((2, 0), 0.7)
    assert t.points(2, BUCKETS) == [(1, 0.7)]
    t.popitem()
    assert sum(len(t.points(d, BUCKETS)) for d in range(3)) == len(t)
    t.clear()
    assert t.points(1, BUCKETS) == [] and t.points(0, BUCKETS) == []


def test_same_value_keeps_the_points():
    t = CostTable({(0, 0): 0.1})
    first = t.points(0, BUCKETS)
    t[(0, 0)] = 0.1        # what every steady step writes (the window's minimum, unchanged)
    assert t.points(0, BUCKETS) is first
    t[(0, 0)] = 0.2
    assert t.points(0, BUCKETS) is not first and t.points(0, BUCKETS) == [(1, 0.2)]


def test_points_of_a_table_built_whole():
    assert CostTable({(0, 1): 0.2, (0, 0): 0.1}).points(0, BUCKETS) == [(1, 0.1), (2, 0.2)]
