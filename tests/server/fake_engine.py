"""A fake engine with the Engine contract (no model), for the server's async-engine and guard
tests: prompts starting with special ids make it fail in chosen ways."""
from __future__ import annotations

import contextlib
import math
import threading
import time
from types import SimpleNamespace

import httpx
import uvicorn

from adaspec.bench.server import free_port
from adaspec.config import EngineConfig
from adaspec.engine.request import RequestOutput

STEP_FAILS = 299      # a prompt starting with this id makes step() raise
REQUEST_FAILS = 298   # ... makes the engine report an error for that request only
ADD_CRASHES = 297     # ... makes add_request raise a non-ValueError
VOCAB = 300
BLOCK = 16


class FakeEngine:
    """The Engine contract with token t+1 = (7 t + 3) mod 256 and no tokenizer (token-id prompts)."""

    def __init__(self, max_model_len: int = 128, num_blocks: int = 64, step_delay: float = 0.002):
        self.config = EngineConfig.create("fake-model", num_blocks=num_blocks)
        self.tokenizer = None
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.step_delay = step_delay
        self.reqs: dict[str, SimpleNamespace] = {}
        self.generation_tokens = 0
        self.steps = 0
        self.thread_ids: set[int] = set()
        self.aborted: list[str] = []
        self.gate = threading.Event()  # cleared: step() stalls (to pile up requests)
        self.gate.set()

    def _blocks(self, r) -> int:
        return math.ceil((len(r.prompt) + len(r.out)) / BLOCK)

    def add_request(self, request_id, prompt, params):
        self.thread_ids.add(threading.get_ident())
        if isinstance(prompt, str):
            raise ValueError("a text prompt needs a tokenizer")
        if not prompt:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= VOCAB for t in prompt):
            raise ValueError(f"prompt token id out of range [0, {VOCAB})")
        if prompt[0] == ADD_CRASHES:
            raise RuntimeError("add crashed")
        self.reqs[request_id] = SimpleNamespace(prompt=list(prompt), params=params, out=[])

    def abort_request(self, request_id):
        if self.reqs.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished(self):
        return bool(self.reqs)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        time.sleep(self.step_delay)
        self.gate.wait()
        self.steps += 1
        if any(r.prompt[0] == STEP_FAILS for r in self.reqs.values()):
            raise RuntimeError("step exploded")
        outs = []
        for rid, r in list(self.reqs.items()):
            if r.prompt[0] == REQUEST_FAILS:
                del self.reqs[rid]
                outs.append(RequestOutput(rid, r.prompt, list(r.out), None, [], None, True, "abort", {},
                                          error="the request broke"))
                continue
            last = (r.out or r.prompt)[-1]
            tok = (7 * last + 3) % 256
            r.out.append(tok)
            self.generation_tokens += 1
            done = len(r.out) >= r.params.max_tokens
            if done:
                del self.reqs[rid]
            outs.append(RequestOutput(rid, r.prompt, list(r.out), None, [tok], None, done,
                                      "length" if done else None, {}))
        return outs

    def stats(self):
        used = sum(self._blocks(r) for r in self.reqs.values())
        return {"verify_steps": 0, "draft_tokens": 0, "accepted_tokens": 0, "accept_length": 0.0,
                "accept_rate_per_position": [], "accepted_per_position": [], "drafted_per_position": [],
                "spec_steps": 0, "nonspec_steps": self.steps, "draft_len_histogram": {0: self.steps},
                "last_draft_len": 0, "policy": "off", "num_running": len(self.reqs), "num_waiting": 0,
                "num_free_blocks": self.num_blocks - used, "num_total_blocks": self.num_blocks,
                "num_preemptions": 0, "prompt_tokens": 0, "generation_tokens": self.generation_tokens,
                "prefix_cache_hit_tokens": 0}


def expected(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (7 * last + 3) % 256
        out.append(last)
    return out


@contextlib.contextmanager
def serve_in_thread(app, **config):
    """Run `app` with uvicorn on a free port in a daemon thread until the block ends;
    yields (url, port, server) once /health answers 200 (uvicorn.Config keywords in `config`)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield url, port, server
    finally:
        server.should_exit = True
        thread.join(10)
