"""Structured outputs and tools through the HTTP server (speculation always, a random head),
driven by the clients people use: the official `openai` SDK, LangChain and LiteLLM. The tiny
model has a tool-capable (Hermes-style) chat template (adaspec.testing.CHAT_TEMPLATE); the
grammar makes its output parse. The server is the session's (tests/server/conftest.py)."""
from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from server_helpers import MODEL_NAME

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["name", "rank"],
        "properties": {"name": {"type": "string", "maxLength": 4}, "rank": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9}}}


@pytest.fixture(scope="module")
def client(spec_server):
    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0)


def _chat(client, **kw):
    kw = {"max_tokens": 60, "temperature": 0.0, **kw}
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], **kw)


def test_structured_outputs_openai_sdk(client, spec_server):
    r = _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                                              "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    assert r.choices[0].finish_reason == "stop"
    r = _chat(client, response_format={"type": "json_object"}, max_tokens=8)
    assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=20, temperature=0.0,
                                  extra_body={"guided_choice": ["red", "green"]})
    assert r.choices[0].text in ("red", "green")
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=20, temperature=0.7, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
    # Streaming and continuous usage: every chunk carries the usage so far.
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
                        extra_body={"guided_json": CITY}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), CITY)
    seen = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert seen and seen == sorted(seen) and seen[-1] == chunks[-1].usage.completion_tokens
    # What cannot be served is a 400 naming the field.
    for body, param in [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
                         "response_format"),
                        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
                        ({"guided_regex": "[a", "guided_choice": ["a"]}, "guided_choice"),
                        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
                        ({"functions": [{"name": "f"}]}, "functions"),
                        ({"tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
                        ({"continue_final_message": True}, "continue_final_message")]:
        resp = httpx.post(spec_server.url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Hi"}], **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.text)


def test_tools_rendered_forced_and_streamed(client, spec_server):
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Oslo", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
               {"role": "user", "content": "And Paris?"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER], max_tokens=60,
                                       temperature=0.0, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}},
                                       extra_body={"return_token_ids": True})
    c = r.choices[0]
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and c.finish_reason == "tool_calls" and c.message.content is None
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(spec_server.proc.args[spec_server.proc.args.index("--model") + 1])
    prompt = tok.decode(c.model_extra["prompt_token_ids"])
    assert '"name": "get_weather"' in prompt and '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"' \
        in prompt and "<|tool|>sunny</s>" in prompt
    # required: at least one call, and one only without parallel_tool_calls.
    r = _chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    # Streaming a named call: the name first, then the arguments as they come.
    args, names = "", []
    for ch in _chat(client, tools=[WEATHER], stream=True,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}}):
        for d in ch.choices[0].delta.tool_calls or []:
            names += [d.function.name] if d.function.name else []
            args += d.function.arguments or ""
    assert names == ["get_weather"]
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    # auto: this model writes no <tool_call>, so the text is content; none: content too.
    for choice in ("auto", "none"):
        r = _chat(client, tools=[WEATHER], tool_choice=choice, max_tokens=5)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_chat_template_switches(spec_server):
    def prompt(**body):
        resp = httpx.post(spec_server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}],
            "max_tokens": 1, "return_token_ids": True, **body})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["prompt_token_ids"]

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(spec_server.proc.args[spec_server.proc.args.index("--model") + 1])
    assert tok.decode(prompt()).endswith("Sure</s><|assistant|>")
    assert tok.decode(prompt(add_generation_prompt=False)).endswith("Sure</s>")
    assert tok.decode(prompt(add_generation_prompt=False, continue_final_message=True,
                             chat_template_kwargs={"continue_final": True})).endswith("Sure")
    assert tok.decode(prompt(chat_template_kwargs={"greet": True})).endswith("<|assistant|>HI")


def test_langchain_and_litellm(spec_server):
    from pydantic import BaseModel, Field

    lc = pytest.importorskip("langchain_openai")

    class City(BaseModel):
        name: str = Field(max_length=4)
        rank: int = Field(ge=0, le=9)

    llm = lc.ChatOpenAI(base_url=spec_server.url + "/v1", api_key="none", model=MODEL_NAME, temperature=0,
                        max_tokens=60, max_retries=0)
    city = llm.with_structured_output(City, method="json_schema").invoke("A city")
    assert isinstance(city, City)

    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")   # bounded arguments: they complete
    msg = bound.invoke("Weather?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert set(msg.tool_calls[0]["args"]) == {"city", "days"}
    acc = None
    for chunk in bound.stream("Weather?"):
        acc = chunk if acc is None else acc + chunk
    assert acc.tool_calls and acc.tool_calls[0]["name"] == "get_weather"

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model=f"hosted_vllm/{MODEL_NAME}", api_base=spec_server.url + "/v1", api_key="none",
                           messages=[{"role": "user", "content": "Hi"}], max_tokens=60, temperature=0,
                           response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}})
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)


def test_grammar_refused_under_tensor_parallelism():
    """A server whose engine has tensor_parallel_size > 1 answers a constrained request with
    a 400 naming the field (the mask would never reach the other ranks), before any work."""
    from types import SimpleNamespace

    from adaspec.server.protocol import APIError
    from adaspec.server.structured_request import GrammarCheck
    from adaspec.structured import StructuredOutput

    check = GrammarCheck(None, SimpleNamespace(config=SimpleNamespace(tensor_parallel_size=2)))
    check(None, "response_format")   # nothing to constrain: fine
    with pytest.raises(APIError, match="response_format: structured outputs .* tensor_parallel_size > 1") as e:
        check(StructuredOutput("json"), "response_format")
    assert e.value.status == 400 and e.value.body()["error"]["param"] == "response_format"
