"""`adaspec compare --configs` (labels, per-configuration flags), p50/p99 latency in the
comparison, the three-panel plot, and the load experiment's plan, merge, ratios and README
(`adaspec/bench/experiment.py`, `benchmarks/load_experiment.py`)."""
from __future__ import annotations

import argparse
import json

import pytest

from adaspec.bench import compare as bench_compare
from adaspec.bench import experiment as X
from adaspec.bench.client import ApiTarget, build_payload
from adaspec.bench.configs import ServerConfig, check_flags, parse_configs, parse_policy, split_items
from adaspec.bench.datasets import SampleRequest
from adaspec.bench.report import compare_rows, compare_table, make_figure, plot_runs, sweep_table
from adaspec.config import add_engine_cli_args
from adaspec.server.cli import build_serve_parser
from helpers import load_benchmark

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ============================================================================ --configs syntax

def test_configs_old_syntax_still_parses():
    cfgs = parse_configs("off, always,threshold:8,auto")
    assert [(c.label, c.policy, c.disable_bs, c.flags) for c in cfgs] == [
        ("off", "off", None, ()), ("always", "always", None, ()),
        ("threshold:8", "threshold", 8, ()), ("auto", "auto", None, ())]
    assert parse_policy("threshold:8") == ("threshold", 8)


def test_configs_json_form_equals_the_short_form(tmp_path):
    short = parse_configs("off,chain3=always[--num-steps 3],thr=threshold:8,"
                          "idle=always[--request-json '{\"speculate\": false}']")
    text = json.dumps([{"policy": "off"}, {"label": "chain3", "policy": "always", "flags": ["--num-steps", "3"]},
                       {"label": "thr", "policy": "threshold:8"},
                       {"label": "idle", "policy": "always", "request": {"speculate": False}}])
    assert parse_configs(text) == short
    path = tmp_path / "configs.json"
    path.write_text(text)
    assert parse_configs(str(path)) == short
    for bad, match in (('[{"policy": "sometimes"}]', "unknown configuration"), ('[{"policy": "off", "x": 1}]',
                       "unknown keys"), ('[{"policy": "off"}, {"policy": "off"}]', "repeats the label"),
                       ('[{"policy": 1}]', "must be one of"), ("[{", "not valid JSON")):
        with pytest.raises(ValueError, match=match):
            parse_configs(bad)


def test_configs_labels_and_flags():
    text = ("off,chain3=always[--num-steps 3 --topk 1],"
            "tree16=always[--num-steps 2 --topk 4 --num-draft-tokens 16],"
            "threshold:32[--num-steps 3 --topk 1],auto,idle=threshold:1,"
            "q=always[--served-model-name 'a,b c' --num-steps=2],"
            """idle2=always[--num-steps 3 --request-json '{"speculate": false, "stop_token_ids": [7]}']""")
    cfgs = parse_configs(text)
    assert [c.label for c in cfgs] == ["off", "chain3", "tree16", "threshold:32", "auto", "idle", "q", "idle2"]
    assert cfgs[1] == ServerConfig("chain3", "always", None, ("--num-steps", "3", "--topk", "1"))
    assert cfgs[2].flags == ("--num-steps", "2", "--topk", "4", "--num-draft-tokens", "16")
    assert (cfgs[3].policy, cfgs[3].disable_bs) == ("threshold", 32)
    assert (cfgs[5].policy, cfgs[5].disable_bs, cfgs[5].flags) == ("threshold", 1, ())
    # a comma and a space inside quotes inside brackets stay in the flag value
    assert cfgs[6].flags == ("--served-model-name", "a,b c", "--num-steps=2")
    # --request-json is compare's own: split off the server flags (brackets inside quotes are free)
    assert cfgs[7].flags == ("--num-steps", "3") and cfgs[6].request_json is None
    assert cfgs[7].request_fields == {"speculate": False, "stop_token_ids": [7]}
    # to_text round-trips
    assert parse_configs(",".join(c.to_text() for c in cfgs)) == cfgs
    assert split_items("a=off[x,y],b") == ["a=off[x,y]", "b"]


@pytest.mark.parametrize("text, match", [
    ("", "empty"),
    ("off,sometimes", "unknown configuration"),
    ("always:3", "takes no argument"),
    ("threshold", "threshold:N"),
    ("threshold:0", ">= 1"),
    ("chain3=always[--num-steps 3", r"'\[' without '\]'"),
    ("chain3=always--num-steps 3]", r"'\]' without '\['"),
    ("a=always[[--topk 2]]", "nested"),
    ("a=always[--topk 2]x", "nothing may follow"),
    ("[--topk 2]", "flags without a policy"),
    ("bad label=always", "bad label"),
    (":x=always", "bad label"),
    ("off=always", "names another policy"),
    ("always,always[--num-steps 5]", "repeats the label 'always'"),
    ("a=always[--served-model-name 'x]", "'\\[' without '\\]'"),      # the quote never closes
    ("a=always[--served-model-name x']", "'\\[' without '\\]'"),
    ("a=always[--request-json]", "needs a JSON object"),
    ("a=always[--request-json '{x}']", "not JSON"),
    ("a=always[--request-json 3]", "non-empty JSON object"),
    ("a=always[--request-json '{}']", "non-empty JSON object"),
    ("a=always[--request-json '{\"a\": 1}' --request-json='{\"b\": 2}']", "given twice"),
])
def test_configs_bad_syntax(text, match):
    with pytest.raises(ValueError, match=match):
        parse_configs(text)


def test_config_flags_checked_with_the_server_parser():
    serve = build_serve_parser()
    ok = parse_configs("c=always[--num-steps 3 --topk 1 --enforce-eager]")[0]
    assert check_flags(ok, serve) == {"num_steps": 3, "topk": 1, "enforce_eager": True}
    # a flag given with its default value still counts as given (it must override)
    assert check_flags(parse_configs("c=always[--topk 1]")[0], build_serve_parser()) == {"topk": 1}
    for text, match in [("c=always[--num-step 3]", "unrecognized"),
                        ("c=always[--topk x]", "invalid int"),
                        ("c=always[--dtype float8]", "invalid choice"),
                        ("c=always[--speculation auto]", "--speculation cannot be set"),
                        ("c=off[--port 9]", "--port cannot be set"),
                        ("c=auto[--model /x]", "--model cannot be set"),
                        ("c=threshold:4[--spec-disable-batch-size 8]", "threshold:N sets it"),
                        ("c=always[--help]", "exits the parser")]:
        with pytest.raises(ValueError, match=match):
            check_flags(parse_configs(text)[0], build_serve_parser())


def test_request_json_reaches_the_request_body():
    cfg = parse_configs("""idle=always[--request-json '{"speculate": false}']""")[0]
    target = ApiTarget(base_url="http://x", model="m", extra_body=tuple(cfg.request_fields.items()))
    body = build_payload(target, SampleRequest(prompt=[5, 6], prompt_len=2, output_len=3))
    assert body["speculate"] is False and body["prompt"] == [5, 6] and body["max_tokens"] == 3
    assert "speculate" not in build_payload(ApiTarget(base_url="http://x", model="m"),
                                            SampleRequest(prompt=[5], prompt_len=1, output_len=1))


def _compare_ns(argv):
    p = argparse.ArgumentParser()
    add_engine_cli_args(p)
    p.add_argument("--configs")
    return p, p.parse_args(argv)


def test_per_config_flags_override_the_shared_ones():
    p, a = _compare_ns(["--model", "M", "--draft", "D", "--num-steps", "5", "--device", "cpu",
                        "--spec-simulate-accept-rate", "0.8"])
    chain, tree, off, own = parse_configs(
        "chain3=always[--num-steps 3 --topk 1],tree16=always[--num-steps 2 --topk 4 --num-draft-tokens 16],"
        "off,own=threshold:4[--draft D2 --spec-simulate-accept-rate 0.5]")
    cmd, ns = bench_compare.config_server_command(p, a, chain, 1234)
    assert cmd.count("--num-steps") == 1 and cmd[cmd.index("--num-steps") + 1] == "3"
    assert (ns.num_steps, ns.topk, ns.device, ns.spec_simulate_accept_rate) == (3, 1, "cpu", 0.8)
    assert cmd[cmd.index("--port") + 1] == "1234" and cmd[cmd.index("--draft") + 1] == "D"
    _, ns = bench_compare.config_server_command(p, a, tree, 1)
    assert (ns.num_steps, ns.topk, ns.num_draft_tokens) == (2, 4, 16)
    cmd, ns = bench_compare.config_server_command(p, a, off, 1)
    assert "--draft" not in cmd and ns.num_steps == 5 and ns.speculation == "off"
    cmd, ns = bench_compare.config_server_command(p, a, own, 1)
    assert cmd.count("--draft") == 1 and ns.draft == "D2" and ns.spec_simulate_accept_rate == 0.5
    assert (ns.speculation, ns.spec_disable_batch_size) == ("threshold", 4)
    # the engine's own validation of the resulting config (nothing is loaded)
    bad = parse_configs("t=always[--num-steps 2 --topk 4 --num-draft-tokens 40]")[0]
    with pytest.raises(ValueError, match="configuration 't'.*impossible"):
        bench_compare.config_server_command(p, a, bad, 1)
    p2, nodraft = _compare_ns(["--model", "M"])
    with pytest.raises(ValueError, match="needs --draft"):
        bench_compare.config_server_command(p2, nodraft, chain, 1)


def test_compare_rejects_bad_configs_before_starting_servers(tmp_path, capsys):
    for configs, match in [("off,tree=always[--topk 4 --num-steps 2 --num-draft-tokens 99]", "impossible"),
                           ("off,c=always[--num-step 3]", "unrecognized"),
                           ("off,c=always[--num-steps 3", "without"),
                           ("off,off", "repeats the label")]:
        with pytest.raises(SystemExit) as e:
            bench_compare.compare_main(["--model", str(tmp_path), "--draft", str(tmp_path), "--configs", configs,
                                    "--out-dir", str(tmp_path / "out")])
        assert e.value.code == 2
        assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()          # nothing started, nothing written


# ============================================================================ latency in the report

def _lv(c, tput, tpot=10.0, ttft=5.0, acc=None, steps=None):
    return {"mode": "closed", "concurrency": c, "output_throughput": tput, "completed": 4, "failed": 0,
            "request_throughput": 1.0, "total_token_throughput": tput * 2, "median_ttft_ms": ttft,
            "p99_ttft_ms": ttft * 3, "median_tpot_ms": tpot, "p99_tpot_ms": tpot * 2, "mean_itl_ms": 1.0,
            "mean_e2el_ms": 9.0, "acceptance_length": acc, "spec_verify_steps": steps}


def test_p50_p99_in_rows_and_tables():
    runs = {"off": {"levels": [_lv(1, 100.0, tpot=7.25, ttft=11.5), _lv(4, 300.0)]},
            "chain3": {"levels": [_lv(4, 250.0, tpot=3.5, ttft=20.0, acc=2.9)]}}   # level 1 missing
    rows = compare_rows(runs)
    assert [r["level"] for r in rows] == ["1", "4"]
    assert rows[0]["median_tpot_ms"] == {"off": 7.25, "chain3": None}
    assert rows[0]["p99_tpot_ms"]["off"] == 14.5 and rows[0]["p99_ttft_ms"]["off"] == 34.5
    assert rows[1]["median_ttft_ms"] == {"off": 5.0, "chain3": 20.0}
    assert rows[1]["p99_ttft_ms"]["chain3"] == 60.0 and rows[1]["acceptance_length"]["chain3"] == 2.9
    text = compare_table(rows, ["off", "chain3"])
    lines = {tuple(line.split()[:2]): line.split() for line in text.splitlines() if line.strip()}
    # level, config, tok/s, x best, TPOT p50, TPOT p99, TTFT p50, TTFT p99, acc len
    assert lines[("4", "chain3")][2:] == ["250.0", "0.83", "3.50", "7.00", "20.0", "60.0", "2.90"]
    assert lines[("1", "off")][4:8] == ["7.25", "14.50", "11.5", "34.5"]
    header = sweep_table(runs["off"]).splitlines()[0]
    assert "TPOT p50" in header and "TPOT p99" in header and "TTFT p50" in header and "TTFT p99" in header
    row = sweep_table(runs["off"]).splitlines()[2].split()
    assert row[6:10] == ["11.5", "34.5", "7.25", "14.50"]


def test_plot_panels_log2_p99_dashed_speculation_and_counts(tmp_path):
    auto = [{**_lv(1, 200.0), "acceptance_length": 2.5, "mean_draft_len": 3.0, "completed": 8},
            {**_lv(256, 800.0), "acceptance_length": 1.4, "mean_draft_len": 0.5, "completed": 64}]
    runs = {"off": {"levels": [_lv(1, 100.0), _lv(4, 300.0), _lv(256, 900.0)]},
            "auto": {"levels": auto},
            "dead": {"levels": [], "error": "x"}}
    fig = make_figure(runs, "T", simulated=0.8)
    axes = fig.axes
    assert len(axes) == 4
    assert [ax.get_xscale() for ax in axes] == ["log", "log", "log", "log"]
    assert [ax.get_yscale() for ax in axes] == ["linear", "linear", "log", "linear"]
    # speculation panel: auto's acceptance length (solid) and chosen draft length (dotted)
    assert [(list(ln.get_ydata()), ln.get_linestyle()) for ln in axes[3].lines] == [([2.5, 1.4], "-"), ([3.0, 0.5], ":")]
    assert {t.get_text() for t in axes[0].texts} >= {"n=8", "n=64"}          # requests per point
    assert list(axes[0].get_xticks()) == [1, 4, 256]
    # throughput: one solid line per configuration with data; latency: p50 solid + p99 dashed
    assert [(ln.get_label(), ln.get_linestyle()) for ln in axes[0].lines] == [("off", "-"), ("auto", "-")]
    assert [ln.get_linestyle() for ln in axes[1].lines] == ["-", "--", "-", "--"]
    assert list(axes[1].lines[1].get_ydata()) == [20.0, 20.0, 20.0]      # off p99 TPOT
    assert list(axes[2].lines[2].get_xdata()) == [1, 256]                 # auto TTFT at its levels
    assert "SIMULATED acceptance rate 0.8" in fig._suptitle.get_text()
    assert plot_runs(tmp_path / "p.png", runs, "T").read_bytes()[:8] == PNG_MAGIC


# ============================================================================ experiment plan, merge, ratios

def test_prompt_plan_is_the_same_for_any_subset():
    counts = X.prompts_per_level(X.LEVELS)
    assert counts == [8, 8, 8, 16, 32, 64, 128, 256, 512]
    full = X.prompt_starts(list(X.LEVELS), counts, num_warmup=2)
    assert full[:3] == [2, 10, 18] and full[-1] == 2 + sum(counts[:-1])
    sub = [64, 256]
    assert X.prompt_starts(sub, X.prompts_per_level(sub), num_warmup=2) == [full[6], full[8]]
    with pytest.raises(ValueError):
        X.prompt_starts([64], [5], num_warmup=2)


def test_default_configs_parse_and_roles():
    cfgs = {c.label: c for c in parse_configs(X.default_configs(24))}
    assert list(cfgs) == ["off", "chain3", "tree16", "thr24", "auto", "idle"]
    assert (cfgs["thr24"].policy, cfgs["thr24"].disable_bs) == ("threshold", 24)
    assert (cfgs["idle"].policy, cfgs["idle"].request_fields) == ("always", {"speculate": False})
    assert "--num-draft-tokens" in cfgs["tree16"].flags and cfgs["auto"].policy == "auto"
    assert X.roles_for(24)["threshold"] == "thr24"
    serve = build_serve_parser()
    for c in cfgs.values():
        check_flags(c, serve)


def _run(levels: dict[int, float], policy: str, steps=None) -> dict:
    return {"policy": policy, "error": None,
            "levels": [_lv(c, v, steps=steps) for c, v in levels.items()]}


def _synthetic() -> dict:
    runs = {
        "off": _run({1: 100.0, 64: 4000.0, 128: 7000.0, 256: 12000.0}, "off"),
        "chain3": _run({1: 250.0, 64: 5000.0, 128: 6500.0, 256: 9000.0}, "always"),
        "tree16": _run({1: 300.0, 64: 2000.0, 128: 3000.0, 256: 4000.0}, "always"),
        "thr32": _run({1: 250.0, 64: 4000.0, 128: 7000.0, 256: 12000.0}, "threshold"),
        "auto": _run({1: 270.0, 64: 5200.0, 128: 7700.0, 256: 12600.0}, "auto"),
        "idle": _run({1: 95.0, 64: 3800.0, 128: 6600.0, 256: 11400.0}, "threshold", steps=0),
    }
    return {"configs": runs, "reference": {"llm_generate": {"output_tok_s": 15000.0, "level": 256},
                                           "hf_cb": {"paged|sdpa:256": 1500.0}}}


def test_experiment_ratios_on_a_synthetic_result():
    r = X.experiment_ratios(_synthetic())
    assert r["fixed_configs"] == ["off", "chain3", "tree16"]
    assert r["off_over_tree16"] == {"level": 256, "ratio": 3.0}
    assert r["chain3_over_off"] == {"level": 1, "ratio": 2.5}
    assert r["best_fixed"] == {1: "tree16", 64: "chain3", 128: "off", 256: "off"}
    assert r["auto_over_best_fixed"][1] == {"best_fixed": "tree16", "ratio": pytest.approx(0.9)}
    assert r["auto_over_best_fixed"][64]["ratio"] == pytest.approx(1.04)
    assert r["auto_over_off"] == {128: pytest.approx(1.1), 256: pytest.approx(1.05)}
    assert r["auto_over_tree16_where_tree_not_best"] == {64: 2.6, 128: pytest.approx(7700 / 3000),
                                                         256: pytest.approx(3.15)}
    assert r["idle_over_off"] == {64: pytest.approx(0.95), 256: pytest.approx(0.95)}
    assert r["chain3_stops_paying_at"] == 128
    assert r["idle_verify_steps"] == 0
    assert r["server_over_llm_generate"]["ratio"] == pytest.approx(0.8)
    assert r["server_over_llm_generate"]["met"] is False
    assert r["server_over_hf_cb"]["ratio"] == pytest.approx(8.0)
    # missing figures give None, not an exception; a reference of another level is not used
    res = _synthetic()
    del res["configs"]["tree16"]
    res["reference"]["llm_generate"]["level"] = 128
    res["configs"]["idle"]["levels"][0]["spec_verify_steps"] = 7
    r = X.experiment_ratios(res)
    assert r["off_over_tree16"]["ratio"] is None and r["auto_over_tree16_where_tree_not_best"] == {}
    assert r["server_over_llm_generate"]["ratio"] is None and r["idle_verify_steps"] == 7
    lines = "\n".join(X.ratio_lines(r))
    assert "off / tree16 at 256: **-**" in lines and "must be 0" in lines


def test_merge_parts():
    full = _synthetic()["configs"]
    part_a = {"date": "d1", "simulated_acceptance": 0.8, "dataset": "random",
              "configs": {"off": full["off"], "idle": full["idle"],
                          "chain3": {**full["chain3"], "levels": full["chain3"]["levels"][:2]}},
              "part": {"name": "a", "llm_generate": {"output_tok_s": 1.0, "level": 256}}}
    late = dict(full["chain3"]["levels"][1], output_throughput=5555.0)   # level 64 again
    part_b = {"date": "d2", "simulated_acceptance": 0.8,
              "configs": {"auto": full["auto"],
                          "chain3": {**full["chain3"], "levels": [late] + full["chain3"]["levels"][2:]}},
              "part": {"name": "b", "hf_cb": {"paged|sdpa:256": 2.0},
                       "llm_generate": {"output_tok_s": 9.0, "level": 64}}}
    m = X.merge_parts([part_b, part_a], order=["off", "chain3", "auto", "idle"])
    assert list(m["configs"]) == ["off", "chain3", "auto", "idle"]
    assert [lv["concurrency"] for lv in m["configs"]["chain3"]["levels"]] == [1, 64, 128, 256]
    # part a came later in the list: its level 64 replaced part b's, and that is noted
    assert m["configs"]["chain3"]["levels"][1]["output_throughput"] == 5000.0
    assert any("chain3 level 64" in n for n in m["merge_notes"])
    assert m["configs"]["chain3"]["parts"] == ["b", "a"]
    assert m["reference"] == {"hf_cb": {"paged|sdpa:256": 2.0},
                              "llm_generate": {"output_tok_s": 1.0, "level": 256}}   # the highest level
    assert m["simulated_acceptance"] == 0.8 and [p["name"] for p in m["parts"]] == ["b", "a"]
    assert [r["level"] for r in m["comparison"]] == ["1", "64", "128", "256"]
    assert m["comparison"][0]["best"] == "auto"


def test_merge_keeps_an_error_until_a_later_part_reruns_or_finishes_its_levels():
    full = _synthetic()["configs"]["auto"]
    cut = {"configs": {"auto": {**full, "levels": full["levels"][:2], "error": "interrupted"}},
           "part": {"name": "cut"}}
    rerun = {"configs": {"auto": {**full, "error": None}}, "part": {"name": "rerun"}}
    partial = {"configs": {"auto": {**full, "levels": full["levels"][1:2], "error": None}},
               "part": {"name": "partial"}}
    assert X.merge_parts([cut, rerun])["configs"]["auto"]["error"] is None
    assert len(X.merge_parts([cut, rerun])["configs"]["auto"]["levels"]) == len(full["levels"])
    # a rerun of fewer levels than the cut part reached, or the cut part coming last, keeps it
    assert X.merge_parts([cut, partial])["configs"]["auto"]["error"] == "interrupted"
    assert X.merge_parts([rerun, cut])["configs"]["auto"]["error"] == "interrupted"
    # a continuation: the levels of the cut part's plan that it did not reach, run by a later part
    plan = [lv["concurrency"] for lv in full["levels"]]
    cut_planned = {**cut, "part": {"name": "cut", "levels": plan}}
    rest = {"configs": {"auto": {**full, "levels": full["levels"][2:], "error": None}},
            "part": {"name": "rest", "levels": plan[2:]}}
    merged = X.merge_parts([cut_planned, rest])
    assert merged["configs"]["auto"]["error"] is None and len(merged["configs"]["auto"]["levels"]) == len(plan)
    assert any("clears part cut's error" in n for n in merged["merge_notes"])
    # ... but not when a planned level is still missing, nor for a part that recorded no plan
    short = {**rest, "configs": {"auto": {**full, "levels": full["levels"][3:], "error": None}}}
    assert X.merge_parts([cut_planned, short])["configs"]["auto"]["error"] == "interrupted"
    assert X.merge_parts([cut, rest])["configs"]["auto"]["error"] == "interrupted"


def test_readme_has_tables_commands_and_ratios():
    res = _synthetic()
    res["comparison"] = compare_rows(res["configs"])
    res["simulated_acceptance_note"] = "SIMULATED ACCEPTANCE: x"
    res["parts"] = [{"name": "a", "command": "python3 benchmarks/load_experiment.py --part a",
                     "device": "NVIDIA H200, 580, 143771 MiB", "date": "2026-12-01", "configs": ["off"],
                     "levels": [1, 256], "duration_s": 100.0}]
    text = X.render_readme(res, X.experiment_ratios(res), title="T", setup=["s1"], merge_command="merge-cmd")
    assert "python3 benchmarks/load_experiment.py --part a" in text and "merge-cmd" in text
    assert "NVIDIA H200" in text and "2026-12-01" in text and "SIMULATED ACCEPTANCE" in text
    assert "| 256 | 12,000.0 | 9,000.0 | 4,000.0 | 12,000.0 | 12,600.0 | 11,400.0 | auto |" in text
    assert "## TPOT p50 / p99 (ms)" in text and "10.00 / 20.00" in text and "5.0 / 15.0" in text
    assert "off / tree16 at 256: **3.00**" in text and "(target >= 0.85: **missed**)" in text


# ============================================================================ end to end on a CPU

@pytest.mark.slow
def test_load_experiment_end_to_end_tiny_cpu(tmp_path, capsys):
    """The whole script on the tiny shape: servers for off, chain3 and idle at concurrency
    1 and 2, the LLM.generate reference, the merge; then --merge of its part elsewhere."""
    le = load_benchmark("load_experiment")
    out = tmp_path / "le"
    rc = le.main(["--out-dir", str(out), "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                  "--levels", "1,2", "--input-len", "16", "--output-len", "8", "--min-prompts", "3",
                  "--only", "off,chain3,idle", "--part", "a", "--server-timeout", "120",
                  "--tar", str(tmp_path / "a.tar.gz")])
    assert rc == 0, capsys.readouterr().err[-3000:]
    res = json.loads((out / "compare.json").read_text())
    assert list(res["configs"]) == ["off", "chain3", "idle"]
    for name, run in res["configs"].items():
        assert run["error"] is None
        assert [(lv["concurrency"], lv["completed"], lv["total_output_tokens"]) for lv in run["levels"]] \
            == [(1, 3, 24), (2, 4, 32)]
        assert [lv["first_prompt"] for lv in run["levels"]] == X.prompt_starts([1, 2], [3, 4], 2, min_prompts=3)
    assert res["configs"]["chain3"]["levels"][0]["spec_verify_steps"] > 0
    r = res["ratios"]
    assert r["idle_verify_steps"] == 0                     # the draft is loaded but never used
    assert r["chain3_over_off"]["ratio"] > 0 and r["idle_over_off"]["2"] > 0     # JSON: str keys
    llm = res["reference"]["llm_generate"]
    assert (llm["num_requests"], llm["output_tokens"], llm["level"]) == (4, 32, 2)
    assert r["server_over_llm_generate"]["ratio"] == pytest.approx(
        res["configs"]["off"]["levels"][1]["output_throughput"] / llm["output_tok_s"])
    readme = (out / "README.md").read_text()
    assert "--only off,chain3,idle" in readme and "| 2 |" in readme and "TTFT p50 / p99" in readme
    assert (out / "compare.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "part-a" / "server-idle.log").exists()
    # merging the part (the directory, or the --tar file the device sends back) elsewhere
    # gives the same comparison
    for n, src in enumerate([out, tmp_path / "a.tar.gz"]):
        other = tmp_path / f"merged{n}"
        assert le.main(["--out-dir", str(other), "--merge", str(src)]) == 0
        again = json.loads((other / "compare.json").read_text())
        assert again["comparison"] == res["comparison"] and (other / "part-a" / "part.json").exists()
        assert list((other).glob("part-*")) == [other / "part-a"]
        assert "--merge" in (other / "README.md").read_text()


def test_load_experiment_plan_and_bad_selection(capsys):
    le = load_benchmark("load_experiment")
    assert le.main(["--dry-run", "--only", "tree16,auto", "--part", "b", "--levels", "64,256"]) == 0
    out = capsys.readouterr().out
    assert "--num-prompts 128,512" in out and "--prompt-starts 138,522" in out
    assert "tree16=always[--num-steps 2 --topk 4 --num-draft-tokens 16]" in out
    assert "adaspec.bench.offline" not in out          # no `off` in this part: no reference
    with pytest.raises(SystemExit):
        le.main(["--dry-run", "--only", "chain4"])
    assert "unknown labels ['chain4']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        le.main(["--dry-run", "--part", "a+b"])
    assert "--part" in capsys.readouterr().err
