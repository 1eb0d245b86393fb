"""The paged-attention launch table (layers/attention/launch_table.py): lookup rules, and the
kernel taking a measured launch (same output as the heuristics' launch, under the interpreter
on CPU)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from adaspec.layers.attention import launch_table

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _entry(bq, bn=32, nw=4, ns=2, sp=1):
    return dict(block_q=bq, block_n=bn, num_warps=nw, num_stages=ns, num_splits=sp, us=1.0)


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A table file standing in for the shipped one (the module reads TABLE_FILE per call)."""
    t = {}
    for q, b, e in [(1, 1, _entry(1, sp=4)), (1, 64, _entry(1, bn=64)), (4, 1, _entry(2, sp=2)),
                    (4, 256, _entry(4, bn=64, ns=3))]:
        launch_table.merge_entry(t, 8, 16, q, b, e)
    path = tmp_path / "attention_configs.json"
    path.write_text(json.dumps(t))
    monkeypatch.setattr(launch_table, "TABLE_FILE", path)
    launch_table.clear_cache()
    yield t
    launch_table.clear_cache()


def test_lookup_nearest_batch_and_covering_q(table):
    assert launch_table.lookup(8, 16, 1, 1)["num_splits"] == 4
    assert launch_table.lookup(8, 16, 1, 4)["num_splits"] == 4      # log2 distance 2 vs 4
    assert launch_table.lookup(8, 16, 1, 16)["block_n"] == 64       # 4 vs 2: the b=64 entry
    assert launch_table.lookup(8, 16, 1, 1000)["block_n"] == 64     # past the largest: the largest
    assert launch_table.lookup(8, 16, 3, 1)["block_q"] == 2         # q=3: the q=4 entry covers it
    assert launch_table.lookup(8, 16, 4, 200)["num_stages"] == 3
    assert launch_table.lookup(8, 16, 5, 1) is None                 # longer than measured: heuristics
    assert launch_table.lookup(4, 16, 1, 1) is None                 # another layout
    assert launch_table.lookup(8, 32, 1, 1) is None                 # another head dim
    assert launch_table.lookup(8, None, 1, 1)["num_splits"] == 4    # the layout's only head dim
    assert set(launch_table.lookup(8, 16, 1, 1)) == set(launch_table.FIELDS)
    assert len(launch_table.entries(8, 16)) == 4 and launch_table.entries(4, 16) == []


def test_missing_table_is_empty(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_table, "TABLE_FILE", tmp_path / "none.json")
    launch_table.clear_cache()
    assert launch_table.lookup(8, 128, 1, 1) is None and launch_table.entries(8, 128) == []
    launch_table.clear_cache()


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_block_q_from_the_table(table):
    from adaspec.layers.attention.triton_kernels import choose_block_q

    assert choose_block_q(4, 8, num_reqs=1) == 2        # the table's, not the heuristics' 4... or 8 rows
    assert choose_block_q(4, 8, num_reqs=256) == 4
    assert choose_block_q(2, 8, num_reqs=256) == 2      # never wider than the request needs
    assert choose_block_q(4, 4, num_reqs=1) == 4        # G=4 is not in the table: the heuristics
