"""Offline tests of the benchmark tool: pure parts, and the client/sweep/CLI against a small
fake OpenAI-compatible server (FastAPI in a thread), independent of the engine."""
from __future__ import annotations

import asyncio
import httpx
import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from adaspec.bench import cli as bench_cli
from adaspec.bench import compare as bench_compare
from adaspec.bench.client import (ApiTarget, build_payload, chunk_text,
                                  make_client, send_request)
from adaspec.bench.configs import parse_policy
from adaspec.bench.datasets import (CodeDataset, JsonlDataset, RandomDataset, SampleRequest,
                                    load_dataset)
from adaspec.bench.metrics import (level_metrics, parse_prometheus_text, percentile, spec_counters,
                                   spec_delta, summarize)
from adaspec.bench.client import RequestResult
from adaspec.bench.report import compare_rows, compare_table, plot_runs, write_json
from adaspec.bench.server import ServerProcess, ServerStartError, free_port
from adaspec.bench.sweep import Level, SweepConfig, find_simulated_acceptance, run_sweep

SPEC_BENCH = Path("/work/shared/data/spec_bench_question.jsonl")


# ============================================================================ fake server

class FakeState:
    """What the fake server saw and how it behaves. Each streamed request adds
    `steps_per_request` verify steps with `accepted_per_step` accepted tokens (position 0
    always, position 1 every other step) to the adaspec counters on /metrics."""

    def __init__(self) -> None:
        self.inflight = 0
        self.max_inflight = 0
        self.bodies: list[dict] = []
        self.token_delay = 0.002
        self.send_usage = True
        self.metrics_style = "adaspec"      # "adaspec" | "vllm" | "none"
        self.server_info: dict | None = {"config": {"spec_simulate_accept_rate": 0.6}}
        self.steps = 0
        self.acc = [0, 0]
        self.drafted = [0, 0]
        self.lock = threading.Lock()

    def metrics_text(self) -> str:
        if self.metrics_style == "adaspec":
            lines = ["# TYPE adaspec_spec_verify_steps_total counter",
                     f"adaspec_spec_verify_steps_total {self.steps}",
                     f"adaspec_spec_draft_tokens_total {sum(self.drafted)}",
                     f"adaspec_spec_accepted_tokens_total {sum(self.acc)}"]
            for i in range(2):
                lines.append(f'adaspec_spec_accepted_per_position_total{{position="{i}"}} {self.acc[i]}')
                lines.append(f'adaspec_spec_drafted_per_position_total{{position="{i}"}} {self.drafted[i]}')
            return "\n".join(lines) + "\n"
        if self.metrics_style == "vllm":
            lab = 'engine="0",model_name="fake"'
            return (f"vllm:spec_decode_num_drafts_total{{{lab}}} {self.steps}\n"
                    f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {sum(self.drafted)}\n"
                    f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {sum(self.acc)}\n"
                    + "".join(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {self.acc[i]}\n'
                              for i in range(2)))
        return "# nothing\n"


def make_fake_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok")

    @app.get("/server_info")
    async def server_info():
        if state.server_info is None:
            return JSONResponse({"detail": "no"}, status_code=404)
        return state.server_info

    @app.get("/metrics")
    async def metrics():
        if state.metrics_style == "none":
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(state.metrics_text())

    async def handle(req: Request, chat: bool):
        body = await req.json()
        state.bodies.append(body)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if prompt == "ERROR":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = int(body["max_tokens"])
        ptoks = len(prompt) if isinstance(prompt, list) else len(prompt.split())

        async def gen():
            state.inflight += 1
            state.max_inflight = max(state.max_inflight, state.inflight)
            try:
                if prompt == "HANG":
                    await asyncio.sleep(3600)
                if chat:
                    yield 'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
                for i in range(n):
                    await asyncio.sleep(state.token_delay)
                    if chat:
                        c = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                    else:
                        c = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
                    yield f"data: {json.dumps(c)}\n\n"
                    if prompt == "DROP" and i == 1:
                        return
                fin = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
                yield f"data: {json.dumps(fin)}\n\n"
                with state.lock:
                    for s in range(n // 2):
                        state.steps += 1
                        state.drafted[0] += 1
                        state.drafted[1] += 1
                        state.acc[0] += 1
                        state.acc[1] += s % 2
                if state.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                    u = {"choices": [], "usage": {"prompt_tokens": ptoks, "completion_tokens": n,
                                                  "total_tokens": ptoks + n}}
                    yield f"data: {json.dumps(u)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.inflight -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await handle(req, chat=True)

    return app


@pytest.fixture(scope="module")
def fake():
    state = FakeState()
    port = free_port()
    config = uvicorn.Config(make_fake_app(state), host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield state, f"http://127.0.0.1:{port}"
    server.should_exit = True
    th.join(timeout=10)


@pytest.fixture
def fresh(fake):
    state, url = fake
    state.__init__()
    return state, url


def _run(coro):
    return asyncio.run(coro)


async def _one(url, sample, **kw):
    async with make_client() as client:
        return await send_request(client, ApiTarget(base_url=url, model="fake-model", **kw), sample)


# ============================================================================ statistics

def test_percentile_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    s = summarize("ttft", [10.0, 20.0, 30.0])
    assert s == {"mean_ttft_ms": 20.0, "median_ttft_ms": 20.0,
                 "std_ttft_ms": pytest.approx(math.sqrt(200 / 3)), "p99_ttft_ms": pytest.approx(29.8)}
    assert summarize("itl", []) == {"mean_itl_ms": None, "median_itl_ms": None,
                                    "std_itl_ms": None, "p99_itl_ms": None}


def test_level_metrics_formulas():
    ok1 = RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, itl=[0.05] * 4, latency=0.3)
    ok2 = RequestResult(success=True, prompt_len=20, output_tokens=1, ttft=0.2, itl=[], latency=0.2)
    bad = RequestResult(success=False, error="timed out after 1s", prompt_len=7, latency=1.0)
    m = level_metrics([ok1, ok2, bad], duration=2.0)
    assert (m["completed"], m["failed"], m["num_requests"]) == (2, 1, 3)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == 1.0
    assert m["output_throughput"] == 3.0
    assert m["total_token_throughput"] == 18.0
    # TPOT only for requests with > 1 output token: (0.3 - 0.1) / 4 = 50 ms
    assert m["mean_tpot_ms"] == pytest.approx(50.0) and m["p99_tpot_ms"] == pytest.approx(50.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["median_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_itl_ms"] == pytest.approx(50.0)
    assert m["mean_e2el_ms"] == pytest.approx(250.0)
    assert m["errors"] == {"timed out after 1s": 1}
    empty = level_metrics([bad], duration=1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["output_throughput"] == 0.0


# ============================================================================ Prometheus

ADASPEC_TEXT = """# HELP adaspec_spec_verify_steps_total Request-steps that verified draft tokens.
# TYPE adaspec_spec_verify_steps_total counter
adaspec_spec_verify_steps_total 100.0
adaspec_spec_verify_steps_created 1.7e9
adaspec_spec_draft_tokens_total 300.0
adaspec_spec_accepted_tokens_total 150.0
adaspec_spec_accepted_per_position_total{position="0"} 80.0
adaspec_spec_accepted_per_position_total{position="1"} 50.0
adaspec_spec_accepted_per_position_total{position="2"} 20.0
adaspec_spec_drafted_per_position_total{position="0"} 100.0
adaspec_spec_drafted_per_position_total{position="1"} 100.0
adaspec_spec_drafted_per_position_total{position="2"} 100.0
adaspec_num_requests_running 3.0
"""


def _scaled(text: str, k: float) -> str:
    out = []
    for line in text.splitlines():
        if line.startswith("adaspec_spec") and "created" not in line:
            head, val = line.rsplit(" ", 1)
            line = f"{head} {float(val) * k}"
        out.append(line)
    return "\n".join(out)


def test_prometheus_parse_labels_and_values():
    s = parse_prometheus_text('a_total{x="1",y="q\\"uo,te"} 2.5 1700000000\n# c\nb +Inf\n'
                              'vllm:spec_decode_num_drafts_total{engine="0"} 7\n')
    assert [(x.name, x.labels, x.value) for x in s[:1]] == [("a_total", {"x": "1", "y": 'q"uo,te'}, 2.5)]
    assert s[1].name == "b" and math.isinf(s[1].value)
    assert s[2].name == "vllm:spec_decode_num_drafts_total" and s[2].value == 7
    assert parse_prometheus_text("bad line here\n") == []
    from adaspec.bench.client import server_root
    assert [server_root(u) for u in ("http://h:8000/v1", "http://h:8000/v1/", "http://h:8000/", "http://h/v1x")] \
        == ["http://h:8000", "http://h:8000", "http://h:8000", "http://h/v1x"]     # a page the parser refuses: no figures


def test_spec_delta_mean_draft_length():
    page = ("adaspec_spec_verify_steps_total {v}\nadaspec_spec_accepted_tokens_total {a}\n"
            'adaspec_spec_draft_len_steps_total{{draft_len="0"}} {d0}\n'
            'adaspec_spec_draft_len_steps_total{{draft_len="3"}} {d3}\n')
    before = spec_counters(page.format(v=10, a=10, d0=5, d3=10))
    after = spec_counters(page.format(v=40, a=70, d0=15, d3=40))   # 10 steps at 0, 30 at 3
    d = spec_delta(before, after)
    assert d["mean_draft_len"] == pytest.approx(90 / 40) and d["acceptance_length"] == 3.0


def test_spec_delta_adaspec():
    before = spec_counters(ADASPEC_TEXT)
    after = spec_counters(_scaled(ADASPEC_TEXT, 3.0))   # the level added 200 steps, 300 accepted
    assert before.source == "adaspec" and before.steps == 100
    d = spec_delta(before, after)
    assert d["spec_metrics_source"] == "adaspec"
    assert d["spec_verify_steps"] == 200 and d["spec_accepted_tokens"] == 300
    assert d["spec_draft_tokens"] == 600
    assert d["acceptance_length"] == pytest.approx(1 + 300 / 200)
    assert d["acceptance_rate"] == pytest.approx(0.5)
    assert d["per_position_acceptance_rate"] == pytest.approx([0.8, 0.5, 0.2])


def test_spec_delta_vllm_names_and_labels():
    def page(drafts, dtoks, acc, pos):
        rows = []
        for eng, share in (("0", 0.25), ("1", 0.75)):      # two engines: samples are summed
            lab = f'engine="{eng}",model_name="m"'
            rows += [f"vllm:spec_decode_num_drafts_total{{{lab}}} {drafts * share}",
                     f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {dtoks * share}",
                     f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {acc * share}"]
            rows += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {v * share}'
                     for i, v in enumerate(pos)]
        return "\n".join(rows)

    b = spec_counters(page(10, 30, 12, [6, 4, 2]))
    a = spec_counters(page(50, 150, 72, [36, 24, 12]))
    d = spec_delta(b, a)
    assert d["spec_metrics_source"] == "vllm"
    assert d["acceptance_length"] == pytest.approx(1 + 60 / 40)
    assert d["acceptance_rate"] == pytest.approx(60 / 120)
    assert d["per_position_acceptance_rate"] == pytest.approx([30 / 40, 20 / 40, 10 / 40])


def test_spec_delta_missing_and_degenerate():
    none = spec_delta(None, None)
    assert set(none) >= {"acceptance_length", "per_position_acceptance_rate", "spec_verify_steps"}
    assert all(v is None for v in none.values())
    assert spec_counters("") is None and spec_counters("foo_total 1\n") is None
    # counters without the _total suffix are found too
    c = spec_counters("adaspec_spec_verify_steps 4\nadaspec_spec_accepted_tokens 2\n")
    assert c is not None and c.steps == 4 and c.draft_tokens is None
    # no verify step in the interval (speculation off): counts 0, length unknown
    d = spec_delta(spec_counters(ADASPEC_TEXT), spec_counters(ADASPEC_TEXT))
    assert d["spec_verify_steps"] == 0 and d["acceptance_length"] is None
    # counters that went backwards (restart) give nothing
    assert spec_delta(spec_counters(_scaled(ADASPEC_TEXT, 2)), spec_counters(ADASPEC_TEXT))["acceptance_length"] is None


# ============================================================================ SSE

def test_stream_reads_server_sent_events():
    """The client's stream (httpx-sse): comments, multi-line data and CRLF endings are SSE."""
    page = (': keep-alive\r\n\r\ndata: {"choices": [{"text": "a", "finish_reason": null}]}\r\n\r\n'
            'event: message\nid: 7\ndata: {"choices": [{"text": "b",\ndata: "finish_reason": null}]}\n\n'
            'data: {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 3}}\n\ndata: [DONE]\n\n')

    def answer(request):
        if request.url.path.startswith("/bad"):
            return httpx.Response(200, text="{}", headers={"content-type": "application/json"})
        return httpx.Response(200, text=page, headers={"content-type": "text/event-stream"})

    async def run(url):
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await send_request(client, ApiTarget(base_url=url, model="m"),
                                      SampleRequest(prompt=[1, 2, 3], prompt_len=3, output_len=2))
    ok = asyncio.run(run("http://x"))
    assert ok.success and ok.generated_text == "ab" and ok.output_tokens == 2 and ok.prompt_len == 3
    bad = asyncio.run(run("http://x/bad"))
    assert not bad.success and "not a server-sent event stream" in bad.error


def test_chunk_text_classification():
    assert chunk_text({"choices": [{"text": "hi", "finish_reason": None}]}, "completions") == (True, "hi")
    assert chunk_text({"choices": [{"text": "", "finish_reason": None}]}, "completions") == (True, "")
    assert chunk_text({"choices": [{"text": "", "finish_reason": "length"}]}, "completions") == (False, "")
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, "completions") == (False, "")
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, "chat") == (False, "")
    assert chunk_text({"choices": [{"delta": {"content": "x"}}]}, "chat") == (True, "x")
    assert chunk_text({"choices": [{"delta": {}, "finish_reason": "stop"}]}, "chat") == (False, "")


def test_build_payload():
    t = ApiTarget(base_url="http://h:1/", model="m")
    b = build_payload(t, SampleRequest(prompt=[5, 6], prompt_len=2, output_len=9))
    assert t.url == "http://h:1/v1/completions"
    assert b == {"model": "m", "max_tokens": 9, "temperature": 0.0, "stream": True,
                 "stream_options": {"include_usage": True}, "prompt": [5, 6], "ignore_eos": True}
    tc = ApiTarget(base_url="http://h:1", model="m", endpoint="chat", ignore_eos=False)
    bc = build_payload(tc, SampleRequest(prompt="hey", prompt_len=1, output_len=3))
    assert tc.url == "http://h:1/v1/chat/completions"
    assert bc["messages"] == [{"role": "user", "content": "hey"}] and "ignore_eos" not in bc
    with pytest.raises(ValueError, match="token ids"):
        build_payload(tc, SampleRequest(prompt=[1], prompt_len=1, output_len=3))


# ============================================================================ datasets

def test_random_dataset_deterministic_disjoint_and_bounded():
    ds = RandomDataset(40, 20, 0.5, vocab_size=100, min_token_id=3, seed=7)
    a = ds.sample(30, 0)
    assert a == RandomDataset(40, 20, 0.5, vocab_size=100, min_token_id=3, seed=7).sample(30, 0)
    assert a[10:] == ds.sample(20, 10)                       # request i depends only on i
    assert a[0].prompt != RandomDataset(40, 20, 0.5, vocab_size=100, seed=8).sample(1, 0)[0].prompt
    assert len({tuple(s.prompt) for s in a}) == 30
    for s in a:
        assert 20 <= s.prompt_len <= 60 and len(s.prompt) == s.prompt_len
        assert 10 <= s.output_len <= 30
        assert all(3 <= t < 100 for t in s.prompt)
    fixed = RandomDataset(16, 8, 0.0, seed=0).sample(5)
    assert {(s.prompt_len, s.output_len) for s in fixed} == {(16, 8)}
    with pytest.raises(ValueError):
        RandomDataset(16, 8, 1.0)


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question_id": 1, "turns": ["first one", "second"]}\n\n'
                 '{"question_id": 2, "turns": ["two words"]}\n{"prompt": "plain prompt here"}\n')
    ds = JsonlDataset(p, output_len=5, seed=3, count_tokens=lambda s: len(s.split()))
    assert sorted(ds.prompts) == ["first one", "plain prompt here", "two words"]
    s = ds.sample(6, 0)
    assert [x.prompt for x in s[:3]] == [x.prompt for x in s[3:]]     # cycles in a fixed order
    assert sorted(x.prompt for x in s[:3]) == sorted(ds.prompts)
    assert all(x.output_len == 5 and x.prompt_len == len(x.prompt.split()) for x in s)
    assert JsonlDataset(p, 5, seed=3).sample(3) == JsonlDataset(p, 5, seed=3).sample(3)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"question": "no turns"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        JsonlDataset(bad, 5)


@pytest.mark.skipif(not SPEC_BENCH.exists(), reason="Spec-Bench questions not present")
def test_spec_bench_file():
    ds = load_dataset(str(SPEC_BENCH), input_len=0, output_len=32, seed=0)
    assert len(ds.prompts) == sum(1 for line in SPEC_BENCH.open() if line.strip())
    first = json.loads(SPEC_BENCH.open().readline())["turns"][0]
    assert first in ds.prompts
    assert all(isinstance(s.prompt, str) and s.prompt_len >= 1 for s in ds.sample(50))


def test_code_dataset(tmp_path):
    (tmp_path / "pkg").mkdir()
    lines = [f"def f{i}(x):\n    return x + {i}\n" for i in range(100)]
    (tmp_path / "pkg" / "a.py").write_text("".join(lines))
    (tmp_path / "b.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not python " * 100)
    ds = CodeDataset(tmp_path, input_len=20, output_len=8, count_tokens=lambda s: len(s.split()))
    assert ds.prompts and all(p.endswith("\n") for p in ds.prompts)         # whole lines only
    assert all("not python" not in p for p in ds.prompts)
    body = [p for p in ds.prompts if p.startswith("def f0(")][0]
    assert len(body.split()) <= 20
    assert ds.prompts[0] == "x = 1\n"                  # b.py sorts first; a short file keeps its window
    # consecutive windows cover pkg/a.py; only a tail under a quarter window is dropped
    full, covered = "".join(lines), "".join(ds.prompts[1:])
    assert full.startswith(covered) and len(full[len(covered):].split()) < 20 / 4
    via = load_dataset(f"code:{tmp_path}", input_len=20, output_len=8, seed=0)
    assert via.sample(4) == load_dataset(f"code:{tmp_path}", input_len=20, output_len=8, seed=0).sample(4)
    with pytest.raises(ValueError):
        load_dataset(f"code:{tmp_path / 'missing'}", input_len=20, output_len=8)
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("no-such-thing", input_len=1, output_len=1)


# ============================================================================ client vs fake server

def test_request_completion_with_usage(fresh):
    state, url = fresh
    r = _run(_one(url, SampleRequest(prompt=[1, 2, 3], prompt_len=99, output_len=6)))
    assert r.success, r.error
    assert r.usage_reported and r.output_tokens == 6 and r.prompt_len == 3
    assert r.generated_text == "".join(f"t{i} " for i in range(6))
    assert len(r.itl) == 5 and 0 < r.ttft <= r.latency
    assert r.latency >= r.ttft + sum(r.itl) - 1e-6
    body = state.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 6 and body["prompt"] == [1, 2, 3]


def test_request_without_usage_counts_chunks(fresh):
    state, url = fresh
    state.send_usage = False
    r = _run(_one(url, SampleRequest(prompt="a b", prompt_len=2, output_len=4), endpoint="chat"))
    assert r.success and not r.usage_reported
    assert r.output_tokens == 4 and r.prompt_len == 2
    assert len(r.itl) == 3                    # the role announcement is not a token


def test_request_failures_do_not_raise(fresh):
    state, url = fresh
    err = _run(_one(url, SampleRequest(prompt="ERROR", prompt_len=1, output_len=4)))
    assert not err.success and err.error.startswith("HTTP 500") and "boom" in err.error
    t0 = time.perf_counter()
    hang = _run(_one(url, SampleRequest(prompt="HANG", prompt_len=1, output_len=4), timeout_s=0.5))
    assert not hang.success and "timed out" in hang.error and time.perf_counter() - t0 < 5
    drop = _run(_one(url, SampleRequest(prompt="DROP", prompt_len=1, output_len=8)))
    assert not drop.success and "[DONE]" in drop.error
    dead = _run(_one(f"http://127.0.0.1:{free_port()}", SampleRequest(prompt="x", prompt_len=1, output_len=1)))
    assert not dead.success and "Connect" in dead.error


# ============================================================================ sweep vs fake server

def test_closed_loop_keeps_exactly_c_in_flight(fresh):
    state, url = fresh
    state.token_delay = 0.005
    ds = RandomDataset(8, 10, seed=0)
    cfg = SweepConfig(levels=(Level(concurrency=4),), num_prompts=16, num_warmup=2, progress=False)
    run = _run(run_sweep(ApiTarget(base_url=url, model=""), ds, cfg))
    assert run["model"] == "fake-model" and run["simulated_acceptance"] == 0.6
    assert run["warmup"]["completed"] == 2
    lv = run["levels"][0]
    assert state.max_inflight == 4
    assert lv["completed"] == 16 and lv["failed"] == 0 and lv["concurrency"] == 4
    assert lv["total_output_tokens"] == 160
    assert lv["output_throughput"] == pytest.approx(lv["total_output_tokens"] / lv["duration"])
    # the level's prompts are requests 2..17 of the stream (warm-up took 0..1)
    sent = [b["prompt"] for b in state.bodies]
    assert sent[:2] == [s.prompt for s in ds.sample(2, 0)]
    assert sorted(map(tuple, sent[2:])) == sorted(tuple(s.prompt) for s in ds.sample(16, 2))
    # fake counters: 5 steps per request, 1 + (0,1,0,1,0)/... accepted -> length 1 + 7/5
    assert lv["spec_verify_steps"] == 80
    assert lv["acceptance_length"] == pytest.approx(1 + (16 * 7) / 80)
    assert lv["per_position_acceptance_rate"] == pytest.approx([1.0, 0.4])


def test_open_loop_poisson_and_cap(fresh):
    state, url = fresh
    state.token_delay = 0.01
    ds = RandomDataset(8, 5, seed=0)
    cfg = SweepConfig(levels=(Level(concurrency=3, request_rate=math.inf),), num_prompts=12,
                      num_warmup=0, progress=False)
    run = _run(run_sweep(ApiTarget(base_url=url, model="fake-model"), ds, cfg))
    assert state.max_inflight == 3 and run["levels"][0]["completed"] == 12
    assert run["levels"][0]["mode"] == "open" and run["levels"][0]["max_concurrency"] == 3
    assert run["levels"][0]["request_rate"] == "inf"
    state.__init__()
    state.token_delay = 0.0
    cfg = SweepConfig(levels=(Level(request_rate=40.0),), num_prompts=20, num_warmup=0, progress=False)
    run = _run(run_sweep(ApiTarget(base_url=url, model="fake-model"), ds, cfg))
    lv = run["levels"][0]
    # 20 exponential gaps of mean 25 ms: the sum is ~0.5 s; below 0.1 s has probability < 1e-6
    assert lv["completed"] == 20 and lv["duration"] > 0.1
    assert state.max_inflight < 20


def test_sweep_vllm_metrics_and_no_metrics(fresh):
    state, url = fresh
    state.metrics_style = "vllm"
    state.server_info = None
    ds = RandomDataset(4, 4, seed=0)
    cfg = SweepConfig(levels=(Level(concurrency=2),), num_prompts=4, num_warmup=0, progress=False)
    run = _run(run_sweep(ApiTarget(base_url=url, model="fake-model"), ds, cfg))
    assert run["simulated_acceptance"] is None and run["server_info"] is None
    lv = run["levels"][0]
    assert lv["spec_metrics_source"] == "vllm" and lv["acceptance_length"] == pytest.approx(1 + 12 / 8)
    state.metrics_style = "none"
    run = _run(run_sweep(ApiTarget(base_url=url, model="fake-model"), ds, cfg))
    assert run["levels"][0]["acceptance_length"] is None and run["levels"][0]["completed"] == 4


def test_find_simulated_acceptance():
    assert find_simulated_acceptance({"config": {"spec_simulate_accept_rate": 0.7}}) == 0.7
    assert find_simulated_acceptance({"spec_simulate_accept_rate": 1}) == 1.0
    assert find_simulated_acceptance({"config": {"spec_simulate_accept_rate": None}}) is None
    assert find_simulated_acceptance(None) is None


# ============================================================================ CLI and reports

def test_bench_cli_end_to_end(fresh, tmp_path, capsys):
    state, url = fresh
    out_json, out_png = tmp_path / "r" / "bench.json", tmp_path / "bench.png"
    rc = bench_cli.bench_main(["--url", url, "--concurrency", "1,4", "--num-prompts", "8",
                               "--input-len", "16", "--output-len", "12", "--seed", "3",
                               "--result-json", str(out_json), "--plot", str(out_png), "--disable-tqdm"])
    assert rc == 0
    shown = capsys.readouterr().out
    assert "SIMULATED ACCEPTANCE" in shown and "out tok/s" in shown
    res = json.loads(out_json.read_text())
    assert res["command"].startswith("adaspec bench --url")
    assert res["simulated_acceptance"] == 0.6 and "SIMULATED" in res["simulated_acceptance_note"]
    assert res["config"]["num_prompts"] == 8 and res["dataset"] == "random"
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 4]
    for lv in res["levels"]:
        assert lv["completed"] == 8 and lv["total_output_tokens"] == 96
        assert lv["output_throughput"] == pytest.approx(lv["total_output_tokens"] / lv["duration"])
        for m in ("ttft", "tpot", "itl", "e2el"):
            assert lv[f"median_{m}_ms"] <= lv[f"p99_{m}_ms"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_unreachable_and_bad_args(capsys):
    rc = bench_cli.bench_main(["--url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2",
                               "--disable-tqdm"])
    assert rc == 1
    assert "cannot reach" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_cli.bench_main(["--concurrency", "1,0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        bench_cli.bench_main(["--concurrency", "2", "--request-rate", "3"])
    with pytest.raises(SystemExit):
        bench_cli.bench_main(["--endpoint", "chat", "--dataset", "random"])


def test_bench_cli_all_failing_exits_nonzero(fresh, tmp_path, capsys):
    state, url = fresh
    rc = bench_cli.bench_main(["--url", url, "--concurrency", "1", "--num-prompts", "2",
                               "--num-warmup", "0", "--timeout", "0.001", "--disable-tqdm"])
    assert rc == 1 and "no request completed" in capsys.readouterr().err
    rc = bench_cli.bench_main(["--url", url, "--concurrency", "1", "--num-prompts", "2",
                               "--num-warmup", "1", "--timeout", "0.001", "--disable-tqdm"])
    assert rc == 1 and "warm-up" in capsys.readouterr().err


def test_bench_per_level_prompt_counts_and_starts(fresh, tmp_path):
    """--num-prompts per level and --prompt-starts: each level sends exactly its own slice of
    the dataset stream, and records where it started."""
    state, url = fresh
    out_json = tmp_path / "b.json"
    rc = bench_cli.bench_main(["--url", url, "--concurrency", "1,2", "--num-prompts", "3,5",
                               "--prompt-starts", "10,40", "--num-warmup", "1", "--input-len", "6",
                               "--output-len", "4", "--vocab-size", "100", "--seed", "7",
                               "--result-json", str(out_json), "--disable-tqdm"])
    assert rc == 0
    levels = json.loads(out_json.read_text())["levels"]
    assert [(lv["completed"], lv["first_prompt"]) for lv in levels] == [(3, 10), (5, 40)]
    ds = RandomDataset(6, 4, vocab_size=100, seed=7)
    # (a previous test's timed-out requests may still reach the fake server: keep this test's)
    sent = [b["prompt"] for b in state.bodies if b["max_tokens"] == 4 and len(b["prompt"]) == 6]
    assert len(sent) == 1 + 3 + 5
    assert sent[0] == ds.sample(1, 0)[0].prompt                          # warm-up
    assert sent[1:4] == [s.prompt for s in ds.sample(3, 10)]             # closed loop at 1: in order
    assert sorted(sent[4:]) == sorted(s.prompt for s in ds.sample(5, 40))
    for bad in (["--num-prompts", "3,5,7"], ["--prompt-starts", "10"], ["--prompt-starts", "0,40"]):
        with pytest.raises(SystemExit):
            bench_cli.bench_main(["--url", url, "--concurrency", "1,2", "--num-warmup", "1", *bad])


def test_compare_helpers():
    assert parse_policy("threshold:8") == ("threshold", 8)
    assert parse_policy("auto") == ("auto", None)
    for bad in ("threshold", "threshold:x", "threshold:0", "always:3", "sometimes"):
        with pytest.raises(ValueError):
            parse_policy(bad)
    import argparse
    from adaspec.config import add_engine_cli_args
    p = argparse.ArgumentParser()
    add_engine_cli_args(p)
    a = p.parse_args(["--model", "M", "--draft", "D", "--device", "cpu", "--no-prefix-caching",
                      "--spec-simulate-accept-rate", "0.5", "--num-steps", "3"])
    extra = bench_compare.passthrough_flags(p, a)
    # (--num-steps defaults to "not given", the demo pair's depth differing: given, it is passed on)
    assert extra == ["--device", "cpu", "--no-enable-prefix-caching", "--num-steps", "3",
                     "--spec-simulate-accept-rate", "0.5"]
    cmd = bench_compare.server_command(a, "threshold", 8, 1234, extra)
    assert cmd[1:] == ["-m", "adaspec.cli", "serve", "--model", "M", "--draft", "D",
                       "--speculation", "threshold", "--spec-disable-batch-size", "8",
                       "--host", "127.0.0.1", "--port", "1234", *extra]
    assert "--draft" not in bench_compare.server_command(a, "off", None, 1, [])


def test_compare_report_table_and_plot(tmp_path):
    def lv(c, tput):
        return {"mode": "closed", "concurrency": c, "output_throughput": tput,
                "median_tpot_ms": 10.0, "median_ttft_ms": 5.0}
    runs = {"off": {"levels": [lv(1, 100.0), lv(8, 400.0)]},
            "always": {"levels": [lv(1, 200.0), lv(8, 300.0)]},
            "auto": {"levels": [], "error": "died"}}
    rows = compare_rows(runs)
    assert [r["best"] for r in rows] == ["always", "off"]
    assert rows[0]["ratio_to_best"] == {"off": 0.5, "always": 1.0, "auto": None}
    assert rows[1]["ratio_to_best"]["always"] == pytest.approx(0.75)
    text = compare_table(rows, ["off", "always", "auto"], "T", simulated=0.8)
    assert "SIMULATED ACCEPTANCE" in text and "0.8" in text and "always/best" in text
    throughput_rows = [line for line in text.splitlines() if line.split()[:1] == ["8"]]
    assert "0.75" in throughput_rows[0] and throughput_rows[0].split()[3] == "-"   # auto: no figure
    png = plot_runs(tmp_path / "c.png", runs, "t", simulated=0.8)
    assert png.read_bytes()[:4] == b"\x89PNG"
    p = write_json(tmp_path / "x.json", {"a": float("nan"), "b": [math.inf, 1.0]})
    assert json.loads(p.read_text()) == {"a": None, "b": [None, 1.0]}


def test_server_process_reports_log_tail_on_early_exit(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('loading...'); "
           "sys.stderr.write('RuntimeError: no such model dir\\n'); sys.exit(3)"]
    sp = ServerProcess(cmd, f"http://127.0.0.1:{free_port()}", tmp_path / "s.log", startup_timeout=30)
    with pytest.raises(ServerStartError) as e:
        with sp:
            pass
    assert "exited with code 3" in str(e.value) and "no such model dir" in str(e.value)


def test_server_process_start_health_stop(tmp_path):
    port = free_port()
    script = ("import uvicorn, fastapi\napp = fastapi.FastAPI()\n"
              "@app.get('/health')\ndef h(): return 'ok'\n"
              f"uvicorn.run(app, host='127.0.0.1', port={port}, log_level='warning')\n")
    sp = ServerProcess([sys.executable, "-c", script], f"http://127.0.0.1:{port}",
                       tmp_path / "s.log", startup_timeout=60, stop_grace=10)
    with sp:
        assert sp.proc.poll() is None and sp.startup_s is not None
    assert sp.proc.returncode is not None
    slow = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"],
                         f"http://127.0.0.1:{free_port()}", tmp_path / "t.log", startup_timeout=0.5,
                         stop_grace=5)
    with pytest.raises(ServerStartError, match="not healthy after"):
        with slow:
            pass
    assert slow.proc.returncode is not None


def test_compare_rounds_summary_pairs_each_round():
    """`compare --rounds`: medians over rounds, and each configuration over the first one within
    a round (the host's speed moves from one round to the next: ratios pair figures of one round)."""
    from adaspec.bench.report import rounds_summary, rounds_table

    def lv(c, tput):
        return {"mode": "closed", "concurrency": c, "output_throughput": tput}

    rounds = [{"off": {"levels": [lv(1, 100.0)]}, "auto": {"levels": [lv(1, 160.0)]}},
              {"off": {"levels": [lv(1, 130.0)]}, "auto": {"levels": [lv(1, 156.0)]}},
              {"off": {"levels": [lv(1, 110.0)]}, "auto": {"levels": [], "error": "died"}}]
    (row,) = rounds_summary(rounds, ["off", "auto"])
    assert row["throughput"]["auto"] == [160.0, 156.0, None]
    assert row["ratio"]["auto"] == [pytest.approx(1.6), pytest.approx(1.2), None]
    assert row["median"] == {"off": 110.0, "auto": 158.0}
    assert row["median_ratio"]["auto"] == pytest.approx(1.4) and row["median_ratio"]["off"] == 1.0
    text = rounds_table([row], ["off", "auto"])
    assert "median x off" in text and "1.60 1.20 -" in text
