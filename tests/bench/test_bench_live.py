"""Live tests of `adaspec bench` / `adaspec compare` against the real adaspec server on a tiny
random CPU model. Skipped only when the server module cannot be imported."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("adaspec.server.cli") is None:
    pytest.skip("adaspec.server.cli is not available", allow_module_level=True)

from adaspec.bench import cli as bench_cli
from adaspec.bench import compare as bench_compare
from adaspec.bench.server import ServerProcess, free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CPU = ["--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny(tok_model_dir, tok_head_dir):
    return tok_model_dir, tok_head_dir


def _serve(args: list[str], log: Path) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "adaspec.cli", "serve", *args, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"]
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", log, startup_timeout=180, stop_grace=20)


def _check_level(lv: dict, n: int) -> None:
    assert lv["completed"] == n and lv["failed"] == 0
    assert lv["total_output_tokens"] > 0
    assert lv["output_throughput"] == pytest.approx(lv["total_output_tokens"] / lv["duration"])
    assert lv["request_throughput"] == pytest.approx(n / lv["duration"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < lv[f"median_{m}_ms"] <= lv[f"p99_{m}_ms"], m
        assert lv[f"mean_{m}_ms"] > 0
    assert lv["mean_ttft_ms"] < lv["mean_e2el_ms"]


@pytest.mark.slow
def test_bench_two_levels_against_real_server(tiny, tmp_path, capsys):
    model, head = tiny
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "turns": [t, "again"]}) + "\n" for i, t in enumerate(
        ["Write a haiku about the sea.", "def add(a, b):", "Explain speculative decoding.",
         "Hello world! How are you today?", "List three prime numbers."])))
    with _serve(["--model", model, "--draft", head, "--speculation", "always", *CPU],
                tmp_path / "server.log") as server:
        out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
        rc = bench_cli.bench_main(["--url", server.base_url, "--concurrency", "1,4", "--num-prompts", "8",
                                   "--input-len", "24", "--output-len", "24", "--tokenizer", model,
                                   "--result-json", str(out_json), "--plot", str(out_png),
                                   "--disable-tqdm"])
        assert rc == 0
        res = json.loads(out_json.read_text())
        assert res["model"] and res["simulated_acceptance"] is None
        assert [lv["concurrency"] for lv in res["levels"]] == [1, 4]
        for lv in res["levels"]:
            _check_level(lv, 8)
            assert lv["total_output_tokens"] == 8 * 24             # ignore_eos + max_tokens
            assert lv["total_input_tokens"] == 8 * 24              # usage.prompt_tokens of random ids
            assert lv["spec_metrics_source"] == "adaspec" and lv["spec_verify_steps"] > 0
            assert lv["acceptance_length"] >= 1.0
            assert len(lv["per_position_acceptance_rate"]) == 3    # default chain of 3 drafts
        assert out_png.read_bytes()[:8] == PNG_MAGIC
        # a jsonl dataset through the chat endpoint
        rc = bench_cli.bench_main(["--url", server.base_url, "--endpoint", "chat", "--dataset", str(questions),
                                   "--concurrency", "2", "--num-prompts", "5", "--output-len", "8",
                                   "--num-warmup", "1", "--result-json", str(tmp_path / "chat.json"),
                                   "--disable-tqdm"])
        assert rc == 0
        lv = json.loads((tmp_path / "chat.json").read_text())["levels"][0]
        _check_level(lv, 5)
        assert lv["total_output_tokens"] == 5 * 8
    table = capsys.readouterr().out
    assert "out tok/s" in table and "SIMULATED" not in table


@pytest.mark.slow
def test_compare_off_always(tiny, tmp_path, capsys):
    model, head = tiny
    out = tmp_path / "cmp"
    rc = bench_compare.compare_main(["--model", model, "--draft", head, "--configs", "off,always", *CPU,
                                 "--concurrency", "1,2", "--num-prompts", "4", "--input-len", "16",
                                 "--output-len", "16", "--num-warmup", "1", "--out-dir", str(out),
                                 "--disable-tqdm", "--server-timeout", "180"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "off tok/s" in text and "always tok/s" in text and "always/best" in text
    res = json.loads((out / "compare.json").read_text())
    assert list(res["configs"]) == ["off", "always"] and res["simulated_acceptance"] is None
    for name, run in res["configs"].items():
        assert run["error"] is None, run["error"]
        assert ("--draft" in run["server_command"]) == (name == "always")
        assert [lv["concurrency"] for lv in run["levels"]] == [1, 2]
        for lv in run["levels"]:
            _check_level(lv, 4)
    assert res["configs"]["off"]["levels"][0]["acceptance_length"] is None      # no verify steps
    assert res["configs"]["always"]["levels"][0]["acceptance_length"] >= 1.0
    assert len(res["comparison"]) == 2
    for row in res["comparison"]:
        assert row["best"] in ("off", "always")
        assert row["ratio_to_best"][row["best"]] == 1.0
        assert all(0 < r <= 1.0 for r in row["ratio_to_best"].values())
    assert (out / "compare.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "server-off.log").exists() and (out / "server-always.log").exists()


def chain_acceptance_moments(a: float, k: int) -> tuple[float, float]:
    """Mean and variance of the accepted count X of one verify step of a k-token chain when
    each draft token is accepted with probability `a` until the first rejection:
    P(X = j) = a^j (1 - a) for j < k, P(X = k) = a^k; E[X] = a (1 - a^k) / (1 - a)."""
    probs = [a ** j * (1 - a) for j in range(k)] + [a ** k]
    mean = sum(j * p for j, p in enumerate(probs))
    var = sum(j * j * p for j, p in enumerate(probs)) - mean ** 2
    return mean, var


@pytest.mark.slow
def test_simulated_acceptance_length(tiny, tmp_path, capsys):
    model, head = tiny
    A, k = 0.7, 3
    out = tmp_path / "sim"
    rc = bench_compare.compare_main(["--model", model, "--draft", head, "--configs", "always",
                                 "--load-format", "dummy", "--spec-simulate-accept-rate", str(A),
                                 "--num-steps", str(k), "--topk", "1", *CPU,
                                 "--concurrency", "8", "--num-prompts", "24", "--input-len", "16",
                                 "--output-len", "160", "--num-warmup", "1", "--out-dir", str(out),
                                 "--disable-tqdm", "--server-timeout", "180"])
    assert rc == 0
    assert "SIMULATED ACCEPTANCE" in capsys.readouterr().out
    res = json.loads((out / "compare.json").read_text())
    assert res["simulated_acceptance"] == A and "SIMULATED" in res["simulated_acceptance_note"]
    run = res["configs"]["always"]
    assert run["simulated_acceptance"] == A          # also reported by the server's /server_info
    lv = run["levels"][0]
    n = lv["spec_verify_steps"]
    assert n >= 1000
    mean, var = chain_acceptance_moments(A, k)
    expected = 1 + A * (1 - A ** k) / (1 - A)
    assert expected == pytest.approx(1 + mean)
    # Verify steps are independent, so the mean of n of them is ~ Normal(1 + mean, var / n).
    # A 4-sigma band has a two-sided false-alarm rate of about 6e-5 per run. Chains shortened
    # near max_tokens draft fewer than k tokens; each missing draft position lowers the
    # expected total by at most A, which the second term allows for.
    short = (k * n - lv["spec_draft_tokens"]) / n
    assert 0 <= short < 0.1
    tol = 4 * math.sqrt(var / n) + A * short
    assert abs(lv["acceptance_length"] - expected) <= tol, (lv["acceptance_length"], expected, tol)
    # Position 0 is accepted with probability A in every step that drafts it (binomial, 4 sigma).
    rate0 = lv["per_position_acceptance_rate"][0]
    assert abs(rate0 - A) <= 4 * math.sqrt(A * (1 - A) / n)


@pytest.mark.slow
def test_compare_reports_a_server_that_dies(tmp_path, capsys):
    out = tmp_path / "dead"
    rc = bench_compare.compare_main(["--model", str(tmp_path / "no-such-model"), "--configs", "off", *CPU,
                                 "--concurrency", "1", "--num-prompts", "1", "--out-dir", str(out),
                                 "--disable-tqdm", "--server-timeout", "120"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "exited with code" in err and "no-such-model" in err       # the server's own log tail
    res = json.loads((out / "compare.json").read_text())
    assert "exited with code" in res["configs"]["off"]["error"] and res["configs"]["off"]["levels"] == []
    assert res["comparison"] == []


@pytest.mark.slow
def test_compare_rounds_interleave_and_summarize(tiny, tmp_path, capsys):
    model, head = tiny
    out = tmp_path / "rounds"
    rc = bench_compare.compare_main(["--model", model, "--draft", head, "--configs", "off,always", "--rounds", "2", *CPU,
                                 "--concurrency", "1", "--num-prompts", "2", "--input-len", "8",
                                 "--output-len", "8", "--out-dir", str(out), "--disable-tqdm",
                                 "--server-timeout", "180"])
    assert rc == 0
    assert "over 2 rounds" in capsys.readouterr().out
    res = json.loads((out / "compare.json").read_text())
    assert [list(r) for r in res["rounds"]] == [["off", "always"]] * 2 and res["configs"] == res["rounds"][0]
    started = [res["rounds"][r][c]["server_log"] for r in (0, 1) for c in ("off", "always")]
    assert [Path(p).name for p in started] == ["server-off-round1.log", "server-always-round1.log",
                                                "server-off-round2.log", "server-always-round2.log"]
    assert all(Path(p).exists() for p in started)
    (row,) = res["rounds_summary"]
    assert row["median_ratio"]["off"] == 1.0 and len(row["ratio"]["always"]) == 2
    assert all(r > 0 for r in row["ratio"]["always"])


@pytest.mark.slow
def test_compare_stopped_by_sigterm_keeps_finished_levels_and_stops_its_server(tiny, tmp_path):
    """A device call's time limit ends `adaspec compare` with SIGTERM in the middle of a
    configuration. compare.json already holds the levels that finished (rewritten after each,
    so the part still merges), the configuration is marked as not finished, and the server it
    started (its own session, which the signal does not reach) is stopped."""
    model, _ = tiny
    out = tmp_path / "cut"
    cmd = [sys.executable, "-m", "adaspec.cli", "compare", "--model", model, "--configs", "off", *CPU,
           "--concurrency", "1,2", "--num-prompts", "2,400", "--input-len", "8", "--output-len", "64",
           "--num-warmup", "0", "--out-dir", str(out), "--disable-tqdm",
           "--server-timeout", "180"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 240
        while not (out / "compare.json").exists():     # written when the first level ends
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("no compare.json after the first level:\n" + proc.communicate()[0][-3000:])
            time.sleep(0.2)
        time.sleep(1.0)                                 # into the second level (400 requests)
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130, text[-3000:]
    run = json.loads((out / "compare.json").read_text())["configs"]["off"]
    assert [(lv["concurrency"], lv["completed"]) for lv in run["levels"]] == [(1, 2)]
    assert run["error"] == "interrupted"
    assert "adaspec server stopped" in (out / "server-off.log").read_text()
