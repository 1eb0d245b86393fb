"""benchmarks/parallel_parts.py: the load experiment's parts dealt to GPUs and merged."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_benchmark


def test_groups_are_dealt_to_gpus_in_turn(tmp_path, capsys):
    pp = load_benchmark("parallel_parts")
    groups = pp.parse_groups("off; chain3,auto ;tree16@1,2,4;tree16@128,256")
    assert groups == [("off", None), ("chain3,auto", None), ("tree16", "1,2,4"), ("tree16", "128,256")]
    cmds = pp.part_commands(groups, ["0", "1", "2"], tmp_path, ["--waves", "8", "--levels", "1,2,4,128,256"])
    assert [g for g, _, _ in cmds] == ["0", "1", "2", "0"]
    argv = cmds[2][1]
    assert argv[argv.index("--only") + 1] == "tree16"
    assert argv[len(argv) - 1 - argv[::-1].index("--levels") + 1] == "1,2,4"   # the part's levels come last
    assert len({str(d) for _, _, d in cmds}) == 4 and all(Path(d).parent == tmp_path / "_parts" for _, _, d in cmds)
    assert pp.main(["--out-dir", str(tmp_path), "--gpus", "0,1", "--groups", "off;chain3", "--dry-run",
                    "--", "--shape", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "CUDA_VISIBLE_DEVICES=0" in out and "CUDA_VISIBLE_DEVICES=1" in out and "--merge" in out
    for bad in (["--groups", ";"], ["--groups", "@1,2"], ["--groups", "off", "--", "--only", "off"]):
        with pytest.raises(SystemExit):
            pp.main(["--out-dir", str(tmp_path), "--gpus", "0", *bad])


@pytest.mark.slow
def test_parts_side_by_side_merge_into_one_experiment(tmp_path):
    """On the CPU with the tiny shape: `off` in one part, chain3's two levels in two more, on
    two 'GPUs'; the merge holds both configurations at both levels, each level's requests the
    ones a serial run sends."""
    pp = load_benchmark("parallel_parts")
    rc = pp.main(["--out-dir", str(tmp_path), "--gpus", "0,1", "--groups", "off;chain3@1;chain3@2", "--",
                  "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--levels", "1,2", "--input-len", "16",
                  "--output-len", "8", "--min-prompts", "3", "--server-timeout", "120"])
    assert rc == 0
    res = json.loads((tmp_path / "compare.json").read_text())
    for label in ("off", "chain3"):
        assert [(lv["concurrency"], lv["completed"], lv["total_output_tokens"], lv["first_prompt"])
                for lv in res["configs"][label]["levels"]] == [(1, 3, 24, 2), (2, 4, 32, 5)]
    assert res["configs"]["chain3"]["levels"][1]["spec_verify_steps"] > 0
    assert "llm_generate" in res["reference"]
    assert sorted(p.name for p in tmp_path.glob("part-*")) == ["part-chain3-c1", "part-chain3-c2", "part-off-c1_2"]
