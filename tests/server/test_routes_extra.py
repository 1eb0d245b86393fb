"""/version, /v1/models/{id}, /tokenize, /detokenize, X-Request-Id and CORS (issue 25)."""
from __future__ import annotations

import httpx
import openai
import pytest

from adaspec import __version__
from adaspec.server.api import ServerSettings, create_app
from adaspec.tokenization import load_tokenizer

from fake_engine import FakeEngine, serve_in_thread

KEY = "sk-test"


@pytest.fixture(scope="module")
def server(tok_model_dir):
    engine = FakeEngine()
    engine.tokenizer = load_tokenizer(tok_model_dir)
    settings = ServerSettings(served_model_name="org/fake", api_key=KEY,
                              allowed_origins=("https://app.example.com",))
    with serve_in_thread(create_app(engine, settings)) as (url, _, _):
        yield url, engine.tokenizer


def test_version_and_model_retrieve(server):
    url, _ = server
    assert httpx.get(url + "/version").json() == {"version": __version__}
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    card = client.models.retrieve("org/fake")          # an id with a slash, as hub names have
    assert card.id == "org/fake" and card.owned_by == "adaspec"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other")
    assert e.value.body["code"] == "model_not_found"


def test_tokenize_detokenize_round_trip(server):
    url, tok = server
    r = httpx.post(url + "/tokenize", json={"prompt": "def add(a, b):"})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode("def add(a, b):")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 128
    plain = httpx.post(url + "/tokenize", json={"prompt": "x", "add_special_tokens": False}).json()["tokens"]
    assert plain == tok.encode("x", add_special_tokens=False)
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    back = httpx.post(url + "/detokenize", json={"tokens": tok.encode("def add(a, b):", add_special_tokens=False)})
    assert back.json() == {"prompt": "def add(a, b):"}
    for path, payload, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                                 ("/detokenize", {"tokens": [10**6]}, "tokens"),
                                 ("/tokenize", {"prompt": "x", "model": "nope"}, "model")):
        r = httpx.post(url + path, json=payload)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_request_id_echo_and_cors_preflight(server):
    url, _ = server
    assert httpx.get(url + "/health", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] == "abc-123"
    made_up = httpx.get(url + "/health").headers["x-request-id"]
    assert len(made_up) == 32
    # A rejection by the guard (no API key) carries it too.
    assert httpx.get(url + "/v1/models", headers={"X-Request-Id": "r1"}).headers["x-request-id"] == "r1"
    pre = httpx.options(url + "/v1/completions", headers={
        "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example.com"
    other = httpx.options(url + "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
