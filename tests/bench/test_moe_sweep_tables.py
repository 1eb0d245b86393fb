"""benchmarks/kernels/moe_sweep.py's table writer: a sweep of some token counts updates only
their buckets of an existing launch table."""
import importlib
import json

from adaspec.layers.moe import triton_kernels as tk
from tests.helpers import BENCHMARKS


def _sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS / "kernels"))   # its own imports (bench_attention)
    return importlib.import_module("moe_sweep")


def test_update_replaces_only_the_swept_buckets(monkeypatch, tmp_path):
    ms = _sweep(monkeypatch)
    old = {"E128_H2048_I768": {"128": {"BLOCK_M": 16, "v": "old128"}, "8192": {"BLOCK_M": 64, "v": "old8192"},
                               "32768": {"BLOCK_M": 64, "v": "old32768"},
                               str(1 << 62): {"BLOCK_M": 64, "v": "old32768"}},
           "E128_H2048_I768_small": {"8": {"v": "s8"}, str(1 << 62): {"v": "s8"}},
           "E8_H4096_I14336": {"2048": {"v": "mixtral"}}}
    found = {"aligned": {8192: {"BLOCK_M": 64, "v": "new8192"}}, "small": {}}
    t = ms.launch_tables(found, 128, 2048, 768, old)
    a = t["E128_H2048_I768"]
    assert a["8192"]["v"] == "new8192"
    assert (a["128"]["v"], a["32768"]["v"], a[str(1 << 62)]["v"]) == ("old128", "old32768", "old32768")
    assert list(a) == ["128", "8192", "32768", str(1 << 62)]
    assert t["E128_H2048_I768_small"] == old["E128_H2048_I768_small"]   # no small bucket swept
    assert t["E8_H4096_I14336"] == old["E8_H4096_I14336"]               # another shape's table kept
    assert old["E128_H2048_I768"]["8192"]["v"] == "old8192"             # the input is not changed

    # the largest bucket swept again: the open-ended bucket follows it
    t = ms.launch_tables({"aligned": {32768: {"BLOCK_M": 64, "v": "new32768"}}}, 128, 2048, 768, old)
    assert t["E128_H2048_I768"][str(1 << 62)]["v"] == "new32768"

    # no base: the swept buckets alone, and the kernel's reader picks them by size
    t = ms.launch_tables(found, 128, 2048, 768)
    assert t == {"E128_H2048_I768": {"8192": found["aligned"][8192], str(1 << 62): found["aligned"][8192]}}
    path = tmp_path / "moe_configs.json"
    path.write_text(json.dumps(ms.launch_tables(found, 128, 2048, 768, old)))
    monkeypatch.setattr(tk, "CONFIG_FILE", path)
    tk._table.cache_clear()
    try:
        assert tk._table("E128_H2048_I768")[8192]["v"] == "new8192"
        assert tk._table("E128_H2048_I768")[128]["v"] == "old128"
    finally:
        tk._table.cache_clear()
