"""benchmarks/compare_from_log.py: a cut-short compare run's printed tables become a part
directory that the load experiment's merge unites with the parts that finished."""
from __future__ import annotations

import json

from adaspec.bench.experiment import load_part, merge_parts

from helpers import load_benchmark

LOG = """== off: starting python3 -m adaspec.cli serve --speculation off
-- off
conc   ok  fail  req/s  out tok/s  tot tok/s  TTFT p50  TTFT p99  TPOT p50  TPOT p99  ITL mean  E2EL mean  acc len
------------------------------------------------------------------------------------------------------------------
   1    8     0   1.09      278.9      836.8      59.9      75.1      3.36      3.37      3.36      917.7        -
  16   48     0   2.33      595.6     1786.9     358.5    7985.1     17.64     30.89     17.56     6781.0        -
(latencies in ms; acc len = tokens emitted per verify step, from /metrics)
== chain3: starting python3 -m adaspec.cli serve --speculation always --num-steps 3
-- chain3
conc   ok  fail  req/s  out tok/s  tot tok/s  TTFT p50  TTFT p99  TPOT p50  TPOT p99  ITL mean  E2EL mean  acc len
------------------------------------------------------------------------------------------------------------------
   1    8     0   1.93      495.1     1485.3      59.3      71.0      1.76      1.93      5.25      517.0     2.95
(latencies in ms; acc len = tokens emitted per verify step, from /metrics)
== thr32: starting python3 -m adaspec.cli serve --speculation threshold
"""


def test_tables_become_a_part_that_merges(tmp_path):
    mod = load_benchmark("compare_from_log")
    log = tmp_path / "load_a.log"
    log.write_text(LOG)
    assert mod.main([str(log), "--part", "a", "--out-dir", str(tmp_path / "le"), "--date", "2026-12-03"]) == 0
    part = load_part(tmp_path / "le" / "part-a")
    assert list(part["configs"]) == ["off", "chain3"]   # thr32 never printed a table
    assert part["configs"]["chain3"]["policy"] == "always"   # (fixed configurations are told by policy)
    off = part["configs"]["off"]["levels"]
    assert [lv["concurrency"] for lv in off] == [1, 16]
    assert off[1]["output_throughput"] == 595.6 and off[1]["p99_ttft_ms"] == 7985.1
    assert off[0]["acceptance_length"] is None
    assert part["configs"]["chain3"]["levels"][0]["acceptance_length"] == 2.95
    assert json.loads((tmp_path / "le" / "part-a" / "part.json").read_text())["recovered_from_log"] == str(log)
    rows = merge_parts([part])["comparison"]
    assert rows[0]["throughput"] == {"off": 278.9, "chain3": 495.1} and rows[0]["best"] == "chain3"
    assert rows[1]["throughput"] == {"off": 595.6, "chain3": None}
