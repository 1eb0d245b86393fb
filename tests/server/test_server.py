"""The server end to end: a real `python -m adaspec.cli serve` process on 127.0.0.1 with a tiny
Llama (byte-level BPE tokenizer, chat template) and a random EAGLE-3 head, on CPU.

The session's server (speculation always, tests/server/conftest.py) carries most tests; a second one, without a draft
and with --max-queue-len 2, covers overload and SIGTERM.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from server_helpers import MODEL_NAME, REPO, ServerProcess, metrics, wait_for  # noqa: F401

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def dirs(tok_model_dir, tok_head_dir):
    return tok_model_dir, tok_head_dir


@pytest.fixture(scope="module")
def server(spec_server):
    # One speculative request first, so tests that read speculation stats do not depend on
    # which tests ran on this (session-shared, possibly fresh) server before them.
    httpx.post(spec_server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True}, timeout=60).raise_for_status()
    return spec_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(dirs):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(dirs[0])


def server_stats(url: str) -> dict:
    return httpx.get(url + "/server_info").json()["stats"]



# ----- happy paths -------------------------------------------------------------------------------------
def test_startup_line_models_and_health(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_completion_stream_equals_non_stream(client, tokenizer):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason == "length"
    n_prompt = len(tokenizer.encode(PROMPT))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (n_prompt, 24, n_prompt + 24)

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == n_prompt


def test_chat_stream_equals_non_stream(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer.encode(rendered, add_special_tokens=False))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 16)

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == n_prompt + 16


def test_stop_string_stream_equals_non_stream(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = next((ch for ch in text[3:] if ch.isascii() and ch.isprintable()), None)
    if stop is None:
        pytest.skip("the random model produced no printable ASCII to stop on")
    full = client.completions.create(**kw, stop=[stop, "\u00e9\u00e9\u00e9"])
    assert full.choices[0].text == text[:text.index(stop)]
    assert full.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=[stop, "\u00e9\u00e9\u00e9"],
                                                                             stream=True))
    assert streamed == full.choices[0].text


def test_default_max_tokens_and_eos(client):
    # Completions default to 16 tokens (OpenAI's legacy default); a natural stop is "stop".
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0)
    assert r.usage.completion_tokens <= 16
    assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == 16 else "stop")


@pytest.mark.parametrize("prompts", [["Hello", "def add", PROMPT], [[5, 6, 7], [40, 41]]])
def test_several_prompts_are_several_choices(server, prompts):
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == list(range(len(prompts)))
    assert r["usage"]["completion_tokens"] == 6 * len(prompts)
    for i, p in enumerate(prompts):
        one = httpx.post(server.url + "/v1/completions", json={**body, "prompt": p}, timeout=60).json()
        assert one["choices"][0]["token_ids"] == r["choices"][i]["token_ids"]
        assert one["choices"][0]["text"] == r["choices"][i]["text"]


@pytest.mark.slow
def test_32_concurrent_streams_match_sequential(server):
    prompts = [f"{PROMPT} {i}" for i in range(32)]
    kw = dict(model=MODEL_NAME, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    sequential = [sync.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        async def one(p):
            text = ""
            async for c in await aclient.completions.create(prompt=p, stream=True, **kw):
                text += c.choices[0].text
            return text
        return await asyncio.gather(*(one(p) for p in prompts))
    assert asyncio.run(run()) == sequential


def test_per_request_speculation_opt_out_is_lossless(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    before = metrics(server.url)["adaspec_spec_verify_steps_total"]
    plain = httpx.post(server.url + "/v1/completions", json={**body, "speculate": False}, timeout=60).json()
    assert metrics(server.url)["adaspec_spec_verify_steps_total"] == before
    spec = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    capped = httpx.post(server.url + "/v1/completions", json={**body, "max_draft_tokens": 1}, timeout=60).json()
    assert plain["choices"][0]["token_ids"] == spec["choices"][0]["token_ids"] == capped["choices"][0]["token_ids"]


# ----- disconnects, metrics, info ---------------------------------------------------------------------
def test_client_disconnect_aborts_and_frees_kv(server):
    total = server_stats(server.url)["num_total_blocks"]
    wait_for(lambda: server_stats(server.url)["num_free_blocks"] == total, what="an idle cache")
    aborted_before = metrics(server.url).get('adaspec_request_success_total{finish_reason="abort"}', 0.0)
    gen_before = metrics(server.url)["adaspec_generation_tokens_total"]
    body = {"model": MODEL_NAME, "prompt": "x" * 200, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        next(lines)
        assert server_stats(server.url)["num_free_blocks"] < total  # the request holds KV now
    wait_for(lambda: server_stats(server.url)["num_free_blocks"] == total, what="KV to be released")
    m = metrics(server.url)
    assert m['adaspec_request_success_total{finish_reason="abort"}'] == aborted_before + 1
    assert m["adaspec_generation_tokens_total"] - gen_before < 300
    assert server_stats(server.url)["num_running"] == 0


def test_metrics_move_with_a_request(server):
    before = metrics(server.url)
    for name in ("adaspec_spec_verify_steps_total", "adaspec_spec_draft_tokens_total",
                 "adaspec_spec_accepted_tokens_total", "adaspec_spec_steps_total", "adaspec_nonspec_steps_total",
                 'adaspec_spec_accepted_per_position_total{position="0"}',
                 'adaspec_spec_drafted_per_position_total{position="0"}',
                 'adaspec_spec_draft_len_steps_total{draft_len="3"}', "adaspec_spec_draft_len",
                 "adaspec_spec_accept_length", "adaspec_num_requests_waiting", "adaspec_num_requests_running",
                 "adaspec_kv_free_blocks", "adaspec_kv_total_blocks", "adaspec_prompt_tokens_total"):
        assert name in before, name
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 20,
                                                         "temperature": 0, "ignore_eos": True}, timeout=60).json()
    after = metrics(server.url)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)
    assert delta("adaspec_generation_tokens_total") == r["usage"]["completion_tokens"] == 20
    assert delta("adaspec_prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert delta('adaspec_request_success_total{finish_reason="length"}') == 1
    assert delta("adaspec_spec_verify_steps_total") > 0
    assert delta("adaspec_spec_draft_tokens_total") >= delta("adaspec_spec_verify_steps_total")
    assert delta("adaspec_time_to_first_token_seconds_count") == 1
    assert delta("adaspec_e2e_request_latency_seconds_count") == 1
    assert delta("adaspec_inter_token_latency_seconds_count") == 19
    assert after["adaspec_spec_draft_len"] in (0.0, 1.0, 2.0, 3.0)


def test_server_info(server, dirs):
    info = httpx.get(server.url + "/server_info").json()
    cfg = info["config"]
    assert cfg["model"] == MODEL_NAME and cfg["model_path"] == dirs[0] and cfg["draft"] == dirs[1]
    assert (cfg["policy"], cfg["num_steps"], cfg["topk"], cfg["num_draft_tokens"]) == ("always", 3, 1, 4)
    assert cfg["spec_simulate_accept_rate"] is None and cfg["spec_disable_batch_size"] is None
    assert cfg["max_model_len"] == 512 and cfg["kv_capacity_tokens"] == 512 * 16
    assert cfg["draft_format"] == "SpecForge/SGLang LlamaForCausalLMEagle3"
    # The tiny model's generation_config.json sets no sampling field: OpenAI's defaults apply.
    assert cfg["generation_config"] == "auto"
    assert cfg["sampling_defaults"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    stats = info["stats"]
    assert stats["num_total_blocks"] == 512 and 0 < stats["num_free_blocks"] <= 512
    assert stats["avg_accept_length"] >= 1.0 and stats["verify_steps"] > 0
    assert cfg["tensor_parallel_size"] == stats["tensor_parallel_size"] == 1


# ----- bad input ----------------------------------------------------------------------------------------
LONG = list(range(3, 3 + 600))
BAD_REQUESTS = [
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_draft_tokens": -1}, 400, "max_draft_tokens"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "logprobs": 30}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "presence_penalty": -2.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 5}, 400, "min_tokens"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": ["ok", ""]}, 400, "prompt"),
    ("completions", {"prompt": [1, 100000]}, 400, "prompt"),
    ("completions", {"prompt": [1, -1]}, 400, "prompt"),
    ("completions", {"prompt": ["mixed", [1, 2]]}, 400, "prompt"),
    ("completions", b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("completions", {"prompt": "hi", "top_k": 2**63}, 400, "top_k"),
    ("completions", {"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("completions", {"prompt": LONG}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 100}, 400, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10000},
     400, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": -3},
     400, "temperature"),
    ("chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{e}-{p}" for i, (e, _, _, p) in enumerate(BAD_REQUESTS)])
def test_bad_input_is_4xx_with_openai_error(server, endpoint, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(f"{server.url}/v1/{endpoint}", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if status == 404:
        assert err["code"] == "model_not_found"
    assert httpx.get(server.url + "/health").status_code == 200


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


# ----- the Grafana dashboard against this live /metrics ------------------------------------------------
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, grouping clauses, ranges,
    functions and numbers removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if rest.startswith("(") or m.group() in PROMQL_WORDS:
            continue
        names.add(m.group())
    return names


@pytest.mark.slow
def test_grafana_dashboard_queries_exist_in_live_metrics(server):
    from prometheus_client.parser import text_string_to_metric_families
    httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True}, timeout=60)
    httpx.post(server.url + "/v1/completions", json={"prompt": ""}, timeout=60)      # a rejection
    page = httpx.get(server.url + "/metrics").text
    samples = [s for fam in text_string_to_metric_families(page) for s in fam.samples]
    live = {s.name for s in samples}
    with open(os.path.join(REPO, "dashboards", "grafana_adaspec.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    used = set().union(*map(promql_metric_names, exprs))
    assert len(exprs) >= 20 and "adaspec_spec_accepted_per_position_total" in used
    assert sorted(used - live) == [], "dashboard queries name metrics the server does not serve"
    # The vLLM-named ones carry the model_name label the dashboard filters on.
    assert all(s.labels.get("model_name") == MODEL_NAME for s in samples if s.name.startswith("vllm:"))


# ----- generate from the shell ------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_cli_matches_server(server, dirs):
    model, head = dirs
    out = subprocess.run(
        [sys.executable, "-m", "adaspec.cli", "generate", "--model", model, "--draft", head, "--prompt", PROMPT,
         "--max-tokens", "10", "--ignore-eos", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64"],
        cwd=REPO, capture_output=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"})
    stderr = out.stderr.decode()
    assert out.returncode == 0, stderr
    assert "acceptance length" in stderr and "10 generated" in stderr
    assert re.search(r"engine steps by draft length \{0: \d+, [123]: \d+", stderr), stderr   # prefill, then drafts
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                         "ignore_eos": True}, timeout=60).json()
    # Bytes, not text: the random model may emit a "\r" that universal newlines would rewrite.
    assert out.stdout == (r["choices"][0]["text"] + "\n").encode()


@pytest.mark.slow
def test_generate_cli_bad_input_exits_2(dirs):
    out = subprocess.run([sys.executable, "-m", "adaspec.cli", "generate", "--model", dirs[0], "--prompt-ids",
                          "1,2,999999", "--device", "cpu", "--num-kv-blocks", "64"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "out of range" in out.stderr


# ----- overload and shutdown (a second, deliberately tiny server) -----------------------------------
@pytest.mark.slow
def test_overload_then_sigterm_exits_0(dirs):
    srv = ServerProcess(["--model", dirs[0], "--max-queue-len", "2", "--shutdown-timeout", "0.2",
                         "--num-kv-blocks", "128"])
    try:
        long = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                held = [asyncio.create_task(c.post("/v1/completions", json=long)) for _ in range(2)]
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                rejected = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": "hi"}) for _ in range(8)))
                burst_s = time.monotonic() - t0
                return burst_s, rejected, await asyncio.gather(*held)
        burst_s, rejected, held = asyncio.run(burst())
        assert burst_s < 5
        for r in rejected:
            assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "server_overloaded"
        assert all(r.status_code == 200 for r in held)
        assert httpx.get(srv.url + "/health").status_code == 200
        assert metrics(srv.url)['adaspec_request_rejected_total{reason="server_overloaded"}'] == 8

        # SIGTERM with a stream in flight: 490 tokens take longer than --shutdown-timeout 0.2, so the
        # stream is ended at the deadline with finish_reason "abort", usage and [DONE], not cut.
        body = {**long, "max_tokens": 490, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            next(lines)
            srv.proc.send_signal(signal.SIGTERM)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]]
        assert finish[-1] == "abort" and finish.count("abort") == 1
        usage = json.loads(events[-2])["usage"]
        assert 0 < usage["completion_tokens"] < 490
        code, out = srv.stop()
        assert code == 0, out
        assert sum("adaspec serving" in line for line in out.splitlines()) == 1
    finally:
        srv.stop()


# ----- logprobs, n, penalties through the official SDK (issue 24) ------------------------------------
def test_sdk_logprobs_n_and_penalties(server, client, dirs, tokenizer):
    """Under speculation (always): completions logprobs equal transformers' log-softmax of the
    target; echo puts the prompt's tokens first; n=3 choices are the n=1 requests with seed + i;
    chat logprobs (streamed too) cover every token; logit_bias and penalties act."""
    import torch
    from transformers import AutoModelForCausalLM

    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                  echo=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    c = r.choices[0]
    ids, prompt_ids = c.model_extra["token_ids"], c.model_extra["prompt_token_ids"]
    lp = c.logprobs
    assert c.text.startswith(PROMPT) and len(lp.tokens) == len(prompt_ids) + len(ids) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    hf = AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt_ids + ids])).logits[0], -1)
    seq = prompt_ids + ids
    for j in range(1, len(seq)):
        assert abs(lp.token_logprobs[j] - float(ref[j - 1, seq[j]])) < 1e-3, j
        assert len(lp.top_logprobs[j]) <= 2
        assert max(lp.top_logprobs[j].values()) == pytest.approx(float(ref[j - 1].max()), abs=1e-3)

    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    many = client.completions.create(n=3, seed=5, **kw)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.usage.prompt_tokens == len(prompt_ids) and many.usage.completion_tokens == 18
    singles = [client.completions.create(seed=5 + i, **kw).choices[0].text for i in range(3)]
    assert [ch.text for ch in many.choices] == singles

    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=6, temperature=0, n=2,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-5)   # greedy: the top
    streamed = []
    for ev in client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=6, temperature=0,
                                             logprobs=True, top_logprobs=1, stream=True,
                                             extra_body={"ignore_eos": True}):
        if ev.choices and ev.choices[0].logprobs is not None:
            streamed += ev.choices[0].logprobs.content
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)

    biased = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                       logit_bias={"42": 100},
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    assert biased.choices[0].model_extra["token_ids"] == [42] * 5
    pen = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                    frequency_penalty=2.0, presence_penalty=2.0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True,
                                                "repetition_penalty": 1.5, "min_tokens": 3})
    toks = pen.choices[0].model_extra["token_ids"]
    assert len(toks) == 12 and len(set(toks)) >= 8   # heavy penalties: few repeats
