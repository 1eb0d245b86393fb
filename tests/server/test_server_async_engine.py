"""Server behaviour that needs a misbehaving engine: a fake engine (the Engine contract, with
deterministic tokens and injectable failures) served in-process by uvicorn on a free port.

What is checked here cannot be provoked through the real engine on purpose: step() raising,
one request failing inside the engine, and add_request raising something other than ValueError.
Each must fail only the affected requests, and the server must keep serving.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from adaspec.server.api import ServerSettings, create_app
from fake_engine import ADD_CRASHES, REQUEST_FAILS, STEP_FAILS, FakeEngine, expected, serve_in_thread


@pytest.fixture(scope="module")
def fake_server():
    engine = FakeEngine()
    app = create_app(engine, ServerSettings(served_model_name="fake", max_queue_len=64, shutdown_timeout=2))
    with serve_in_thread(app) as (url, _, _):
        yield SimpleNamespace(url=url, engine=engine, app=app)


def _complete(url, prompt, max_tokens=5, **kw):
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                     "return_token_ids": True, **kw}, timeout=30)


def test_token_id_prompts_and_batches(fake_server):
    r = _complete(fake_server.url, [5, 6, 7])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["token_ids"] == expected([5, 6, 7], 5)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    r = _complete(fake_server.url, [[1, 2], [9], [4, 4, 4]], max_tokens=3)
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in body["choices"]] == [expected(p, 3) for p in ([1, 2], [9], [4, 4, 4])]
    assert body["usage"]["completion_tokens"] == 9 and body["usage"]["prompt_tokens"] == 6


def test_engine_is_only_touched_by_one_thread(fake_server):
    _complete(fake_server.url, [1])
    assert len(fake_server.engine.thread_ids) == 1
    assert threading.get_ident() not in fake_server.engine.thread_ids


def test_text_prompt_without_tokenizer_is_400(fake_server):
    r = _complete(fake_server.url, "hello")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(fake_server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_engine_value_error_is_400(fake_server):
    r = _complete(fake_server.url, [1, 2, 1000])
    assert r.status_code == 400
    assert "out of range" in r.json()["error"]["message"]


def test_step_failure_fails_inflight_requests_and_server_keeps_serving(fake_server):
    async def run():
        async with httpx.AsyncClient(base_url=fake_server.url, timeout=30) as c:
            ok = c.post("/v1/completions", json={"prompt": [3], "max_tokens": 100, "return_token_ids": True})
            bad = c.post("/v1/completions", json={"prompt": [STEP_FAILS], "max_tokens": 5})
            return await asyncio.gather(ok, bad)
    ok, bad = asyncio.run(run())
    # Both were in the batch when step() raised: both fail with a 500, neither hangs.
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
    assert ok.status_code in (200, 500)
    assert httpx.get(fake_server.url + "/health").status_code == 200
    r = _complete(fake_server.url, [5, 6, 7])
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected([5, 6, 7], 5)


def test_streamed_step_failure_ends_with_error_event(fake_server):
    with httpx.stream("POST", fake_server.url + "/v1/completions",
                      json={"prompt": [STEP_FAILS], "max_tokens": 5, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"


def test_one_failing_request_does_not_affect_others(fake_server):
    async def run():
        async with httpx.AsyncClient(base_url=fake_server.url, timeout=30) as c:
            reqs = [c.post("/v1/completions", json={"prompt": [REQUEST_FAILS], "max_tokens": 5})]
            reqs += [c.post("/v1/completions", json={"prompt": [i], "max_tokens": 20, "return_token_ids": True})
                     for i in range(1, 5)]
            return await asyncio.gather(*reqs)
    bad, *good = asyncio.run(run())
    assert bad.status_code == 500
    for i, r in enumerate(good, start=1):
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected([i], 20)


def test_add_crash_is_500_not_fatal(fake_server):
    r = _complete(fake_server.url, [ADD_CRASHES])
    assert r.status_code == 500 and "internal error" in r.json()["error"]["message"]
    assert _complete(fake_server.url, [1]).status_code == 200


def test_batch_with_one_bad_prompt_adds_nothing(fake_server):
    before = fake_server.engine.generation_tokens
    r = _complete(fake_server.url, [[1, 2], [1, 2000]], max_tokens=50)
    assert r.status_code == 400
    time.sleep(0.2)
    assert fake_server.engine.generation_tokens - before < 50  # the good one was aborted at once
    assert not fake_server.engine.reqs


def _wait_aborted(engine, n_before: int) -> None:
    deadline = time.time() + 5
    while (engine.reqs or len(engine.aborted) == n_before) and time.time() < deadline:
        time.sleep(0.02)
    assert not engine.reqs
    assert len(engine.aborted) == n_before + 1


def test_disconnect_aborts_non_streaming_request(fake_server):
    engine = fake_server.engine
    n_before = len(engine.aborted)
    # 120 tokens at >= 2 ms a step take >= 0.24 s; the client gives up after 0.05 s.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.url + "/v1/completions", json={"prompt": [1], "max_tokens": 120}, timeout=0.05)
    _wait_aborted(engine, n_before)


def test_disconnect_aborts_streaming_request(fake_server):
    engine = fake_server.engine
    n_before = len(engine.aborted)
    with httpx.stream("POST", fake_server.url + "/v1/completions",
                      json={"prompt": [1], "max_tokens": 120, "stream": True}, timeout=10) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
    _wait_aborted(engine, n_before)
    assert len(engine.aborted) > n_before


def test_overload_returns_503_with_retry_after(fake_server):
    engine = fake_server.engine
    limit = 64

    async def run():
        async with httpx.AsyncClient(base_url=fake_server.url, timeout=30,
                                     limits=httpx.Limits(max_connections=200)) as c:
            engine.gate.clear()  # the engine stalls, so accepted requests pile up
            try:
                tasks = [asyncio.create_task(c.post("/v1/completions", json={"prompt": [i + 1], "max_tokens": 4}))
                         for i in range(limit + 20)]
                # The 20 over the limit are answered at once, while the engine is still stalled.
                deadline = time.time() + 20
                while sum(t.done() for t in tasks) < 20 and time.time() < deadline:
                    await asyncio.sleep(0.02)
                rejected_early = sum(t.done() for t in tasks)
            finally:
                engine.gate.set()
            return rejected_early, await asyncio.gather(*tasks)
    rejected_early, rs = asyncio.run(run())
    codes = [r.status_code for r in rs]
    assert rejected_early == 20
    assert codes.count(503) == 20 and codes.count(200) == limit
    r503 = next(r for r in rs if r.status_code == 503)
    assert r503.headers["retry-after"] == "1"
    assert r503.json()["error"]["code"] == "server_overloaded"
    assert _complete(fake_server.url, [1]).status_code == 200


def test_batch_larger_than_the_queue_limit_is_400_not_503(fake_server):
    r = _complete(fake_server.url, [[1]] * 65, max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_health_reports_a_stalled_engine(fake_server):
    """/health fails while the engine reports no progress with work pending (Engine.stalled_since)."""
    engine = fake_server.engine
    try:
        engine.stalled_since = time.monotonic() - 60
        r = httpx.get(fake_server.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "stalled"
        engine.stalled_since = time.monotonic()          # within the stall timeout: still ok
        assert httpx.get(fake_server.url + "/health").status_code == 200
    finally:
        engine.stalled_since = None
    assert httpx.get(fake_server.url + "/health").json() == {"status": "ok"}


def test_unexpected_exception_is_500_and_keeps_the_connection(fake_server, monkeypatch):
    serving = fake_server.app.state.serving

    def broken():
        raise RuntimeError("boom")
    monkeypatch.setattr(serving, "server_info", broken)
    with httpx.Client(base_url=fake_server.url, timeout=10) as c:
        r = c.get("/server_info")
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
        monkeypatch.undo()
        r = c.get("/server_info")
        assert r.status_code == 200
        # The same connection (client port) carried both: the 500 did not close it.
        assert r.extensions["network_stream"].get_extra_info("client_addr")[1] == port
