"""benchmarks/feed_summary.py: a policy feed summarized (decode steps by bucket and draft length,
steps with prompt rows by their query rows)."""
import json

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def fs():
    return load_benchmark("feed_summary")


def test_summary_of_a_feed(fs, tmp_path):
    steps = [
        [4, 3, 8000.0, 0, [4, 3, 2], [4, 4, 4], False],      # decode, 4 requests: 1 + 9/4 tokens each
        [4, 3, 10000.0, 0, [4, 4, 4], [4, 4, 4], False],
        [1, 0, 6000.0, 0, [], [], False],                    # decode without drafts
        [3, 3, 20000.0, 100, [2, 2, 2], [2, 2, 2], False],   # 100 + 2 x 4 = 108 query rows
        [3, 3, 30000.0, 120, [2, 2, 2], [2, 2, 2], False],   # 128 rows
        [2, 0, 50000.0, 300, [], [], False],                 # 301 rows
    ]
    feed = tmp_path / "x.123.jsonl"
    feed.write_text("\n".join(json.dumps(s) for s in [{"policy": "always", "num_steps": 3, "topk": 1}] + steps) + "\n")
    r = fs.summarize(feed)
    assert r["policy"] == "always" and r["steps"] == 6 and r["prompt_steps"] == 3
    assert r["total_s"] == 0.12   # 124 ms, in seconds to 2 places
    assert r["prompt_share"] == pytest.approx(100 / 124, abs=1e-3)
    assert r["prompt_median_ms"] == 30.0 and r["prompt_median_rows"] == 120
    by = {(t["batch"], t["draft_len"]): t for t in r["decode"]}
    assert by[(4, 3)]["steps"] == 2 and by[(4, 3)]["median_ms"] == 9.0
    assert by[(4, 3)]["tokens_per_request_step"] == pytest.approx((1 + 9 / 4 + 1 + 12 / 4) / 2)
    assert by[(1, 0)]["tokens_per_request_step"] == 1.0
    assert r["prompt_by_rows"] == [{"rows_from": 0, "steps": 1, "median_ms": 20.0},
                                   {"rows_from": 128, "steps": 1, "median_ms": 30.0},
                                   {"rows_from": 256, "steps": 1, "median_ms": 50.0}]
    assert fs.query_rows([3, 3, 1.0, 100, [], [], False]) == 108   # a feed of before session 22: estimated
    assert fs.query_rows([3, 3, 1.0, 100, [], [], False, 140]) == 140   # recorded


def test_a_feed_with_query_rows_buckets_by_them(fs, tmp_path):
    steps = [[3, 3, 20000.0, 100, [2, 2, 2], [2, 2, 2], False, 300],   # two prompt chunks: 300 rows,
             [1, 0, 6000.0, 0, [], [], False, 1]]                      # not the 108 an estimate gives
    feed = tmp_path / "y.1.jsonl"
    feed.write_text("\n".join(json.dumps(s) for s in [{"policy": "always", "num_steps": 3, "topk": 1}] + steps))
    r = fs.summarize(feed)
    assert r["prompt_by_rows"] == [{"rows_from": 256, "steps": 1, "median_ms": 20.0}]
    assert r["decode"][0]["median_ms"] == 6.0
