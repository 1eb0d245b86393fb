"""Start and stop an `adaspec serve` subprocess for `adaspec compare`.

`ServerProcess` runs the command with stdout and stderr going to one log file, waits for
``GET /health`` to answer 200, and stops the server with SIGTERM, then SIGKILL after a grace
period. If the server exits or does not become healthy in time, `ServerStartError` carries
the tail of its log so the cause is visible on the terminal.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

import httpx

from adaspec.bench.client import BenchError


class ServerStartError(BenchError):
    """The server died or never became healthy; the message ends with its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: str | os.PathLike, lines: int = 40) -> str:
    """The last `lines` lines of a text file ('' if it does not exist)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ServerProcess:
    """A server subprocess. Use as a context manager: entering starts it and waits until it
    is healthy, leaving stops it (whatever happened inside)."""

    def __init__(self, cmd: Sequence[str], base_url: str, log_path: str | os.PathLike, *,
                 startup_timeout: float = 600.0, stop_grace: float = 30.0,
                 env: dict[str, str] | None = None) -> None:
        self.cmd = list(cmd)
        self.base_url = base_url.rstrip("/")
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        finally:
            log.close()

    def wait_healthy(self) -> float:
        """Poll ``/health`` until it answers 200; returns the seconds it took. Raises
        `ServerStartError` (with the log tail) if the process exits or time runs out."""
        assert self.proc is not None, "start() first"
        t0 = time.monotonic()
        url = self.base_url + "/health"
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise ServerStartError(
                        f"server exited with code {code} before becoming healthy\n"
                        f"command: {' '.join(self.cmd)}\n--- last lines of {self.log_path} ---\n"
                        f"{log_tail(self.log_path)}")
                try:
                    if client.get(url).status_code == 200:
                        self.startup_s = time.monotonic() - t0
                        return self.startup_s
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > self.startup_timeout:
                    self.stop()
                    raise ServerStartError(
                        f"server not healthy after {self.startup_timeout:g}s at {url}\n"
                        f"command: {' '.join(self.cmd)}\n--- last lines of {self.log_path} ---\n"
                        f"{log_tail(self.log_path)}")
                time.sleep(0.25)

    def stop(self) -> int | None:
        """SIGTERM, wait up to `stop_grace` seconds, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
