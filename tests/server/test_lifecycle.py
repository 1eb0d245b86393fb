"""The server's life as an operator sees it: a frozen or dead engine process, a second signal
during the drain, a signal or a busy port during start-up. Real `adaspec serve` processes (tiny
Llama with a tokenizer, no draft, CPU) except where an in-process call shows the same thing."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from adaspec.testing import make_tiny_model
from server_helpers import REPO, ServerProcess, wait_for

LONG = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("lifecycle") / "m", "llama", tokenizer=True))


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc, Linux)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def engine_children(pid: int) -> list[int]:
    """Children of `pid` that are multiprocessing spawn children (not its resource tracker)."""
    out = []
    for child in children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(child)
        except OSError:
            pass
    return out


def engine_pid(srv: ServerProcess) -> int:
    pids = wait_for(lambda: engine_children(srv.proc.pid), what="the engine process")
    assert len(pids) == 1, pids
    return pids[0]


def ignores_sigint(pid: int) -> bool:
    """Whether `pid` has SIGINT ignored (the server does while it spawns the engine process,
    so that the child inherits it; a Ctrl-C in those milliseconds is not seen)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (signal.SIGINT - 1)))


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def events_of(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


@pytest.mark.slow
def test_frozen_engine_is_unhealthy_and_dead_engine_exits_nonzero(model_dir):
    short = {**LONG, "max_tokens": 40}
    srv = ServerProcess(["--model", model_dir, "--max-model-len", "512", "--num-kv-blocks", "64",
                         "--stall-timeout", "1"])
    try:
        pid = engine_pid(srv)
        # Frozen with a stream open: /health turns 503 (it sent nothing for > 1 s), then
        # recovers when the engine runs again, and the stream completes.
        with httpx.stream("POST", srv.url + "/v1/completions", json=short, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(pid, signal.SIGSTOP)
            try:
                health = wait_for(lambda: (h := httpx.get(srv.url + "/health", timeout=5)).status_code == 503
                                  and h, timeout=10, what="/health 503 for a frozen engine")
                assert health.json()["status"] == "stalled"
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: httpx.get(srv.url + "/health", timeout=5).status_code == 200,
                     what="/health 200 again")
            events = events_of(lines)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"

        # Killed with a stream open: the stream ends with an error event and [DONE], the
        # cause is logged once, and the server exits non-zero by itself.
        with httpx.stream("POST", srv.url + "/v1/completions", json=short, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(pid, signal.SIGKILL)
            events = events_of(lines)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        srv.proc.wait(timeout=30)
        code, out = srv.stop()
        assert code == 1, out
        assert "Traceback" not in out, out
        assert sum("killed by signal 9" in line and "failing 1 in-flight" in line
                   for line in out.splitlines()) == 1, out
    finally:
        srv.stop()


@pytest.mark.slow
def test_second_signal_ends_the_drain_at_once(model_dir):
    srv = ServerProcess(["--model", model_dir, "--max-model-len", "512", "--num-kv-blocks", "64",
                         "--shutdown-timeout", "120"])
    try:
        pid = engine_pid(srv)
        with httpx.stream("POST", srv.url + "/v1/completions",
                          json={**LONG, "stream_options": {"include_usage": True}}, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            srv.proc.send_signal(signal.SIGTERM)   # drain: up to 120 s for the stream
            # (Two signals sent before the first is handled would merge into one.)
            wait_for(lambda: "SIGTERM: draining 1 in-flight" in srv.output(), what="the drain")
            next(lines)                            # ... the stream keeps going
            srv.proc.send_signal(signal.SIGTERM)   # now
            events = events_of(lines)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
        assert json.loads(events[-2])["usage"]["completion_tokens"] < 400
        srv.proc.wait(timeout=30)     # far less than the 120 s drain
        code, out = srv.stop()
        assert code == 128 + signal.SIGTERM, out
        assert "Traceback" not in out, out
        wait_for(lambda: gone(pid), what="the engine process gone")
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("sig,to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c", "sigterm"])
def test_signal_during_startup_stops_both_processes(model_dir, sig, to_group):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM (to the
    server only, as a supervisor sends it) while the engine process loads."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaspec.cli", "serve", "--model", model_dir, "--device", "cpu",
         "--port", "0", "--num-kv-blocks", "64"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    try:
        child = wait_for(lambda: engine_children(proc.pid), timeout=60, what="the engine process")[0]
        # The child exists while the server still ignores SIGINT around its spawn: wait that out
        # (milliseconds; the child then loads for seconds), else the Ctrl-C is lost by design.
        wait_for(lambda: not ignores_sigint(proc.pid), timeout=30, what="the server to take SIGINT again")
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, out
    assert "Traceback" not in out and "start-up interrupted" in out, out
    wait_for(lambda: gone(child), what="the engine process gone")


def test_port_in_use_fails_before_loading(model_dir, monkeypatch, caplog):
    from adaspec.server import cli

    def no_load(*a, **k):
        raise AssertionError("the engine was loaded although the port is taken")
    monkeypatch.setattr(cli, "_load_engine", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.serve_main(["--model", model_dir, "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text
