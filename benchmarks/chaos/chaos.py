"""Chaos test: normal, slow, disconnecting, oversized and malformed clients against a running
adaspec server for N minutes (not part of CI).

    python benchmarks/chaos/chaos.py --url http://127.0.0.1:8000 --server-pid PID --minutes 10
    python benchmarks/chaos/chaos.py --launch DEMO_DIR --minutes 10     # starts `adaspec serve`

Each of --clients workers loops: pick a behaviour by --mix weight, run it, record its outcome.
At the end it prints requests by behaviour and outcome, the 5xx count (must be 0), answers that
were wrong (a normal request whose completion_tokens is not its max_tokens, a stream without
[DONE]), the KV free count once the server is idle (must equal the total), and the server's RSS
growth from after a warm-up to the end. Exit status 1 if 5xx, wrong answers or a KV leak.

Faults (with --launch): --freeze-at MIN stops the engine process (SIGSTOP) for --freeze-s
seconds, checks that /health answers 503 meanwhile, then resumes it (SIGCONT); --kill-at MIN
kills it (SIGKILL), checks that the server exits non-zero within --exit-within seconds, and
starts a new server. Outcomes inside a fault window (its start to 10 s after recovery) are
counted apart (`...@fault`) and do not fail the run; RSS is then sampled for both processes.

Behaviours:
  normal       completion or chat, stream or not, greedy or sampled, ignore_eos (exact counts)
  slow_reader  a stream read with pauses between chunks
  disconnect   a request abandoned (stream after a chunk or two, non-stream after a random wait)
  slow_body    headers, then part of the body, then silence: the server must cut it (408/close)
  slow_head    part of a request head, then silence: the server must close the connection
  oversized    a body over the server's limit (declared, or chunked without a length): 413
  malformed    bad JSON, lone surrogates, deep nesting, wrong types, long lists, wrong
               content type, bad API key (when --api-key is given): 4xx
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from urllib.parse import urlparse

import httpx

MIX = "normal=50,slow_reader=6,disconnect=14,slow_body=5,slow_head=5,oversized=4,malformed=16"
WORDS = "the quick brown fox jumps over lazy dog hello world def add return speculative decoding".split()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Chaos:
    def __init__(self, args):
        self.args = args
        u = urlparse(args.url)
        self.host, self.port = u.hostname, u.port or 80
        self.outcomes: Counter = Counter()      # (behaviour, outcome) -> count
        self.wrong: list[str] = []
        self.auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.big = b'{"prompt": "' + b"x" * (args.max_request_bytes + 1024) + b'"}'
        mix = dict(kv.split("=") for kv in args.mix.split(","))
        self.behaviours = list(mix)
        self.weights = [float(w) for w in mix.values()]
        self.proc: subprocess.Popen | None = None     # the server, with --launch
        self.windows: list[list] = []                 # [start, end] of each fault (monotonic)
        self.fault_log: list[str] = []
        self.fault_ok = True

    def record(self, behaviour: str, outcome: str) -> None:
        now = time.monotonic()
        if any(start <= now and (end is None or now <= end) for start, end in self.windows):
            outcome += "@fault"
        self.outcomes[(behaviour, outcome)] += 1

    # ---- faults (with --launch) ------------------------------------------------------------------
    def engine_pid(self) -> int | None:
        """The server's engine process (its multiprocessing spawn child), from /proc."""
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and b"spawn_main" in cmd:
                return int(entry)
        return None

    async def faults(self, t0: float) -> None:
        a = self.args
        plan = sorted([(a.freeze_at, "freeze")] * (a.freeze_at is not None)
                      + [(a.kill_at, "kill")] * (a.kill_at is not None))
        for at, kind in plan:
            await asyncio.sleep(max(0.0, t0 + at * 60 - time.monotonic()))
            pid = self.engine_pid()
            window = [time.monotonic(), None]
            self.windows.append(window)
            if kind == "freeze":
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(min(a.freeze_s, a.stall_timeout + 3))
                async with httpx.AsyncClient(base_url=a.url, timeout=10) as c:
                    health = (await c.get("/health")).status_code
                self.fault_log.append(f"freeze: /health {health} while frozen (want 503)")
                self.fault_ok &= health == 503
                await asyncio.sleep(max(0.0, a.freeze_s - (time.monotonic() - window[0])))
                os.kill(pid, signal.SIGCONT)
            else:
                os.kill(pid, signal.SIGKILL)
                t_kill = time.monotonic()
                try:
                    code = await asyncio.to_thread(self.proc.wait, a.exit_within)
                except subprocess.TimeoutExpired:
                    code = None
                    self.proc.kill()
                    self.proc.wait()
                self.fault_log.append(f"kill: the server exited with {code} after "
                                      f"{time.monotonic() - t_kill:.1f} s (want non-zero within {a.exit_within} s)")
                self.fault_ok &= code not in (0, None)
                self.proc = await asyncio.to_thread(launch, a.launch, a)
            window[1] = time.monotonic() + 10.0

    @staticmethod
    def outcome_of(status: int) -> str:
        return "5xx" if status >= 500 else str(status)

    def prompt(self, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))

    def body(self, rng: random.Random, stream: bool) -> tuple[str, dict, int]:
        n = rng.randint(1, 48)
        common = {"model": self.args.model, "max_tokens": n, "stream": stream, "ignore_eos": True,
                  "temperature": rng.choice([0.0, 0.0, 0.8]), "seed": rng.randint(0, 1 << 30)}
        if stream:
            common["stream_options"] = {"include_usage": True}
        if rng.random() < 0.3:
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": self.prompt(rng)}]}, n
        return "/v1/completions", {**common, "prompt": self.prompt(rng)}, n

    # ---- behaviours ------------------------------------------------------------------------------
    async def normal(self, client: httpx.AsyncClient, rng: random.Random, slow: bool = False) -> str:
        stream = slow or rng.random() < 0.5
        path, body, n = self.body(rng, stream)
        if not stream:
            r = await client.post(path, json=body, headers=self.auth)
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] != n:
                self.wrong.append(f"{path}: {r.json()['usage']['completion_tokens']} tokens, asked {n}")
            return self.outcome_of(r.status_code)
        async with client.stream("POST", path, json=body, headers=self.auth) as r:
            if r.status_code != 200:
                await r.aread()
                return self.outcome_of(r.status_code)
            done, usage = False, None
            async for line in r.aiter_lines():
                if slow:
                    await asyncio.sleep(rng.uniform(0.05, 0.5))
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "stream_error_event"
                    usage = event.get("usage") or usage
            if not done or usage is None or usage["completion_tokens"] != n:
                self.wrong.append(f"stream {path}: done={done} usage={usage} asked {n}")
        return "200"

    async def disconnect(self, client: httpx.AsyncClient, rng: random.Random) -> str:
        path, body, _ = self.body(rng, rng.random() < 0.5)
        body["max_tokens"] = 200 if path == "/v1/completions" else body["max_tokens"]
        try:
            if body["stream"]:
                async with client.stream("POST", path, json=body, headers=self.auth) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return self.outcome_of(r.status_code)
                    k = rng.randint(1, 3)
                    async for _ in r.aiter_lines():
                        k -= 1
                        if k == 0:
                            break
            else:
                await asyncio.wait_for(client.post(path, json=body, headers=self.auth), rng.uniform(0.05, 1.0))
                return "finished_first"
        except asyncio.TimeoutError:
            pass
        return "abandoned"

    async def raw(self, data: bytes, wait: float) -> bytes:
        """Send `data` on a fresh connection, then read what comes back within `wait` seconds."""
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            return b"<refused>"   # the server is down (a kill fault, before its restart)
        try:
            writer.write(data)
            await writer.drain()
            out = b""
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    chunk = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    break
                if not chunk:
                    return out + b"<closed>"
                out += chunk
            return out + b"<open>"
        except (ConnectionError, OSError):
            return b"<reset>"
        finally:
            writer.close()

    async def slow_body(self, rng: random.Random) -> str:
        body = json.dumps({"model": self.args.model, "prompt": self.prompt(rng), "max_tokens": 4}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in self.auth.items()) + "\r\n")
        out = await self.raw(head.encode() + body[:len(body) // 2], self.args.client_timeout + 10)
        if out.endswith(b"<open>"):
            return "held_open"   # the server failed to cut it
        status = out.split(b" ", 2)[1].decode() if out.startswith(b"HTTP/1.1") else "closed"
        return "5xx" if status.startswith("5") else status

    async def slow_head(self, rng: random.Random) -> str:
        out = await self.raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty", self.args.client_timeout + 10)
        return "held_open" if out.endswith(b"<open>") else "closed"

    async def oversized(self, client: httpx.AsyncClient, rng: random.Random) -> str:
        headers = {**self.auth, "Content-Type": "application/json"}
        try:
            if rng.random() < 0.5:
                r = await client.post("/v1/completions", content=self.big, headers=headers)
            else:
                async def chunks():
                    for i in range(0, len(self.big), 1 << 16):
                        yield self.big[i:i + (1 << 16)]
                r = await client.post("/v1/completions", content=chunks(), headers=headers)
        except httpx.TransportError:
            return "cut_while_sending"   # the server answered and closed before the body was sent
        return self.outcome_of(r.status_code)

    def malformed_request(self, rng: random.Random) -> tuple[bytes, dict]:
        j = {"Content-Type": "application/json", **self.auth}
        m = self.args.model
        cases = [
            (b"{not json", j),
            (b'{"model": "' + m.encode() + b'", "prompt": "\\ud800 hi", "max_tokens": 2}', j),
            (b'{"model": "\\udfff", "prompt": "hi"}', j),
            (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", j),
            (b'{"a": ' + b"[" * 40 + b"]" * 40 + b', "prompt": "hi"}', j),
            (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), j),
            (json.dumps({"prompt": "hi", "stop": ["x"] * 1000}).encode(), j),
            (json.dumps({"prompt": "hi", "stop_token_ids": list(range(5000))}).encode(), j),
            (json.dumps({"prompt": [5] * 100_000}).encode(), j),
            (json.dumps({"prompt": "word " * 200_000}).encode(), j),
            (json.dumps({"prompt": "hi", "max_tokens": -1}).encode(), j),
            (json.dumps({"prompt": "hi"}).encode(), {"Content-Type": "text/plain", **self.auth}),
            (b"[1, 2]", j),
        ]
        if self.args.api_key:
            cases.append((json.dumps({"prompt": "hi"}).encode(),
                          {"Content-Type": "application/json", "Authorization": "Bearer wrong"}))
        return rng.choice(cases)

    async def malformed(self, client: httpx.AsyncClient, rng: random.Random) -> str:
        body, headers = self.malformed_request(rng)
        r = await client.post("/v1/completions", content=body, headers=headers)
        if r.status_code < 500:
            # The keep-alive connection must still carry a request after an error answer.
            await client.get("/v1/models", headers=self.auth)
        return self.outcome_of(r.status_code)

    # ---- driver --------------------------------------------------------------------------------------
    async def worker(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        timeout = httpx.Timeout(120.0)
        async with httpx.AsyncClient(base_url=self.args.url, timeout=timeout) as client:
            while time.monotonic() < deadline:
                b = rng.choices(self.behaviours, self.weights)[0]
                try:
                    if b == "normal":
                        out = await self.normal(client, rng)
                    elif b == "slow_reader":
                        out = await self.normal(client, rng, slow=True)
                    elif b == "disconnect":
                        out = await self.disconnect(client, rng)
                    elif b == "slow_body":
                        out = await self.slow_body(rng)
                    elif b == "slow_head":
                        out = await self.slow_head(rng)
                    elif b == "oversized":
                        out = await self.oversized(client, rng)
                    else:
                        out = await self.malformed(client, rng)
                except (httpx.HTTPError, OSError) as e:
                    out = f"client_error:{type(e).__name__}"
                self.record(b, out)

    def rss_pair(self, pid: int | None) -> tuple[int, int]:
        """(server, engine) RSS in KiB; the current server when launched, else `pid`."""
        server = self.proc.pid if self.proc is not None else pid
        engine = self.engine_pid() if self.proc is not None else None
        return (rss_kib(server) if server else 0), (rss_kib(engine) if engine else 0)

    async def run(self, pid: int | None) -> int:
        a = self.args
        async with httpx.AsyncClient(base_url=a.url, timeout=60) as c:   # warm-up, then the RSS baseline
            for _ in range(4):
                await c.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 8}, headers=self.auth)
        t0 = time.monotonic()
        deadline = t0 + a.minutes * 60
        rss0: tuple[int, int] = self.rss_pair(pid)

        async def baseline() -> None:   # RSS over the last 5 minutes (or the second half)
            nonlocal rss0
            await asyncio.sleep(max(0.0, deadline - min(5 * 60, a.minutes * 30) - time.monotonic()))
            rss0 = self.rss_pair(pid)
        tasks = [asyncio.create_task(baseline())]
        if self.proc is not None and (a.freeze_at is not None or a.kill_at is not None):
            tasks.append(asyncio.create_task(self.faults(t0)))
        await asyncio.gather(*(self.worker(a.seed + i, deadline) for i in range(a.clients)))
        for t in tasks:
            await t
        elapsed = time.monotonic() - t0
        free = total = None
        async with httpx.AsyncClient(base_url=a.url, timeout=10) as c:
            for _ in range(120):   # abandoned requests are aborted at the next engine step
                stats = (await c.get("/server_info")).json()["stats"]
                free, total = stats["num_free_blocks"], stats["num_total_blocks"]
                if free == total and stats["num_inflight"] == 0:
                    break
                await asyncio.sleep(0.5)
            health = (await c.get("/health")).status_code
            metrics = (await c.get("/metrics")).text
        rss1 = self.rss_pair(pid)
        n5xx = sum(v for (b, o), v in self.outcomes.items() if o == "5xx")
        held = sum(v for (b, o), v in self.outcomes.items() if o == "held_open")
        for line in self.fault_log:
            print("fault " + line)
        print(f"\nchaos run: {elapsed / 60:.1f} min, {a.clients} clients, mix {a.mix}")
        print(f"{'behaviour':<12} {'outcome':<36} {'count':>7}")
        for (b, o), v in sorted(self.outcomes.items()):
            print(f"{b:<12} {o:<36} {v:>7}")
        print(f"total requests: {sum(self.outcomes.values())}")
        print(f"5xx: {n5xx}   held open by the server: {held}   wrong answers: {len(self.wrong)}")
        for w in self.wrong[:10]:
            print("  wrong:", w)
        print(f"KV free after: {free}/{total}   /health: {health}")
        for line in metrics.splitlines():
            if line.startswith(("adaspec_client_disconnects_total", "adaspec_request_rejected_total",
                                "adaspec_num_preemptions")):
                print("  " + line)
        for name, before, after in (("server", rss0[0], rss1[0]), ("engine", rss0[1], rss1[1])):
            if before:
                print(f"{name} RSS: {before / 1024:.0f} MiB at the baseline -> {after / 1024:.0f} MiB at the end "
                      f"({100.0 * (after - before) / before:+.1f}%)")
        ok = (n5xx == 0 and held == 0 and not self.wrong and free == total and health == 200
              and self.fault_ok)
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1


def launch(demo: str, args) -> subprocess.Popen:
    """Start `adaspec serve` on the tiny demo model (written with `python -m adaspec.testing DIR`)."""
    cmd = [sys.executable, "-m", "adaspec.cli", "serve", "--model", f"{demo}/target", "--draft", f"{demo}/draft",
           "--speculation", "auto", "--device", "cpu", "--dtype", "float32", "--served-model-name", args.model,
           "--port", str(urlparse(args.url).port), "--num-kv-blocks", str(args.num_kv_blocks),
           "--max-request-bytes", str(args.max_request_bytes), "--client-timeout", str(args.client_timeout),
           "--stall-timeout", str(args.stall_timeout), "--log-level", "warning"]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    log = open(args.server_log, "a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for _ in range(600):
        try:
            if httpx.get(args.url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}; see {args.server_log}")
        time.sleep(0.2)
    proc.kill()
    sys.exit("server did not become healthy")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="demo", help="served model name")
    p.add_argument("--server-pid", type=int, default=None, help="for RSS figures (Linux /proc)")
    p.add_argument("--launch", metavar="DEMO_DIR", default=None, help="start the server on this demo model")
    p.add_argument("--server-log", default="chaos-server.log")
    p.add_argument("--num-kv-blocks", type=int, default=48, help="with --launch: a small pool, to preempt")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--mix", default=MIX, help="behaviour=weight,...")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024, help="the server's limit")
    p.add_argument("--client-timeout", type=float, default=30.0, help="the server's --client-timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stall-timeout", type=float, default=5.0, help="the server's --stall-timeout")
    p.add_argument("--freeze-at", type=float, default=None, help="minute at which to SIGSTOP the engine")
    p.add_argument("--freeze-s", type=float, default=20.0, help="seconds the engine stays stopped")
    p.add_argument("--kill-at", type=float, default=None, help="minute at which to SIGKILL the engine")
    p.add_argument("--exit-within", type=float, default=15.0,
                   help="seconds the server may take to exit after its engine is killed")
    args = p.parse_args()
    if args.launch:
        open(args.server_log, "w").close()
    chaos = Chaos(args)
    chaos.proc = launch(args.launch, args) if args.launch else None
    pid = chaos.proc.pid if chaos.proc else args.server_pid
    try:
        code = asyncio.run(chaos.run(pid))
    finally:
        proc = chaos.proc
        if proc is not None:
            proc.terminate()
            proc.wait(60)
            print(f"server exit status after SIGTERM: {proc.returncode}")
            if proc.returncode != 0:
                code = 1
            with open(args.server_log) as f:
                tracebacks = f.read().count("Traceback")
            print(f"tracebacks in the server log: {tracebacks}")
    return code


if __name__ == "__main__":
    sys.exit(main())
