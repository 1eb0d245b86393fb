"""Helpers of the server tests: a real `adaspec serve` process, /metrics parsing, waiting."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from adaspec.bench.server import free_port

MODEL_NAME = "tiny-llama"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "adaspec.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port),
             "--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL_NAME],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 90
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> tuple[int, str]:
        """SIGTERM (if still running), wait, and return (exit status, everything it printed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode, self.output()


def metrics(url: str) -> dict[str, float]:
    """{sample name with labels: value} of one /metrics scrape, parsed by prometheus_client."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(cond, timeout: float = 10.0, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
