"""OpenAI's Responses API (`/v1/responses`) on the session's speculative server, through the
official SDK: the answer equals chat's for the same messages, the stream's events and deltas,
incomplete answers, a JSON schema enforced, and what is refused by name."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest

from server_helpers import MODEL_NAME


@pytest.fixture(scope="module")
def client(spec_server):
    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0)


def test_responses_equal_chat_and_stream(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    r = client.responses.create(model=MODEL_NAME, instructions="be brief", input="hi", max_output_tokens=8,
                                temperature=0, extra_body={})
    assert r.object == "response" and r.output[0].role == "assistant" and r.output[0].type == "message"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    same = client.responses.create(model=MODEL_NAME, max_output_tokens=8, temperature=0, input=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
    assert same.output_text == r.output_text
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model=MODEL_NAME, instructions="be brief", input="hi",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text and events[-1].response.status == r.status


def test_responses_incomplete_and_json_schema(client):
    cut = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, temperature=0,
                                  extra_body={})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    js = client.responses.create(model=MODEL_NAME, input="pick", max_output_tokens=40, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert js.status == "completed" and json.loads(js.output_text)["a"] in ("x", "y")
    # the SDK's stream helper (it wants a response.completed event: a completed answer)
    with client.responses.stream(model=MODEL_NAME, input="pick", max_output_tokens=40, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "pick", "schema": schema}}) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        assert s.get_final_response().output_text == "".join(deltas) == js.output_text


@pytest.mark.parametrize("field,value", [("tools", [{"type": "web_search"}]),
                                         ("previous_response_id", "resp_1"), ("background", True),
                                         ("max_output_tokens", 0), ("temperature", -1.0), ("input", []),
                                         ("reasoning", {"effort": "high"}), ("truncation", "auto")])
def test_responses_refusals_name_the_field(spec_server, field, value):
    r = httpx.post(spec_server.url + "/v1/responses", json={"model": MODEL_NAME, "input": "hi", field: value},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "max_tokens" not in r.json()["error"]["message"]


TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                         "required": ["city"], "additionalProperties": False}}]


def test_function_tools_whole_streamed_and_continued(client):
    """tool_choice naming a function (enforced by a grammar): the answer is one function_call
    item, streamed as argument deltas; its output fed back as input items continues the turn."""
    kw = dict(model=MODEL_NAME, input="weather?", tools=TOOLS, max_output_tokens=40, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments == events[-1].response.output[-1].arguments
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[-1].item.type == "function_call" and done[-1].item.status == "completed"
    follow = client.responses.create(model=MODEL_NAME, tools=TOOLS, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert follow.usage.input_tokens > r.usage.input_tokens and follow.output[0].type == "message"
    required = client.responses.create(model=MODEL_NAME, input="weather?", tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    assert [o.type for o in required.output if o.type == "function_call"] and required.status == "completed"


def test_langchain_over_the_responses_api(spec_server):
    """LangChain's ChatOpenAI with use_responses_api: text, streaming, a forced tool call (whole
    and streamed) and with_structured_output."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    def llm(**kw):
        return ChatOpenAI(model=MODEL_NAME, base_url=spec_server.url + "/v1", api_key="none", use_responses_api=True,
                          temperature=0, max_retries=0, **kw)

    assert isinstance(llm(max_tokens=6).invoke("hi").content, (str, list))
    assert len(list(llm(max_tokens=6).stream("hi"))) > 1

    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return "sunny"

    bound = llm(max_tokens=40).bind_tools([get_weather], tool_choice="get_weather")
    calls = bound.invoke("weather?").tool_calls
    assert [c["name"] for c in calls] == ["get_weather"] and calls[0]["args"]["city"] in ("Paris", "Oslo")
    merged = None
    for chunk in bound.stream("weather?"):
        merged = chunk if merged is None else merged + chunk
    assert [c["name"] for c in merged.tool_calls] == ["get_weather"]

    class Pick(BaseModel):
        choice: Literal["x", "y"]

    assert llm(max_tokens=40).with_structured_output(Pick, method="json_schema").invoke("pick").choice in ("x", "y")
