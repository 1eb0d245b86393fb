"""Tool calls read out of model text, per family, whole and streamed (no model needed: the
texts are what Qwen/Hermes, Llama 3.x and Mistral models write)."""
from __future__ import annotations

import json

import pytest

from adaspec.server.chat_tools import ToolOutput
from adaspec.server.tool_parsers import get_tool_parser

CASES = [  # (parser, text, content, [(name, arguments)])
    ("hermes", 'Let me look.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
               '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Let me look.", [("f", {"x": 1}), ("g", {})]),
    ("hermes", "no call here", "no call here", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": </tool_call>', None, []),   # broken: content
    ("llama3_json", '{"name": "f", "parameters": {"city": "Oslo"}}', None, [("f", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": [1]}}', None,
     [("f", {}), ("g", {"a": [1]})]),
    ("llama3_json", "The answer is {not json}", "The answer is {not json}", []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"q": "a"}}, {"name": "g", "arguments": {}}]', None,
     [("f", {"q": "a"}), ("g", {})]),
    ("mistral", 'Sure [TOOL_CALLS]f[ARGS]{"q": 2}[TOOL_CALLS]g[ARGS]{}', "Sure", [("f", {"q": 2}), ("g", {})]),
    ("mistral", "plain", "plain", []),
    ("glm45", "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>opts</arg_key>\n<arg_value>{\"days\": 3}</arg_value>\n</tool_call>"
              "<tool_call>now\n</tool_call>", "Checking.", [("get_weather", {"city": "Paris", "opts": {"days": 3}}),
                                                           ("now", {})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>", None, []),          # unclosed: content
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=search>\n<parameter=query>\nbest pizza\n</parameter>\n"
                    "<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>", "Sure.",
     [("search", {"query": "best pizza", "limit": 5})]),
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=query>\nx", None, []),   # unclosed: content
    ("qwen3_coder", "<tool_call>{\"name\": \"f\"}</tool_call>", None, []),          # another format: content
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse(name, text, content, calls):
    got_content, got = get_tool_parser(name).parse(text)
    if not calls:
        content = text
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_streamed_deltas_hold_back_markers_and_send_calls_complete():
    """Content streams up to where a call may begin; the call comes once complete; a marker
    prefix that turns out to be text is released."""
    out = ToolOutput("auto", None, get_tool_parser("hermes"))
    full = 'Hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    deltas = []
    for n in range(1, len(full) + 1):
        deltas += out.deltas(full[:n], n == len(full))[0]
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Hi " and len(calls) == 1
    assert calls[0]["index"] == 0 and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    plain = ToolOutput("auto", None, get_tool_parser("hermes"))
    assert plain.deltas("a <tool", False)[0] == [{"content": "a "}]
    assert plain.deltas("a <tools are fun", True) == ([{"content": "<tools are fun"}], False)
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name,text", [
    ("glm45", "<tool_call>f\n<arg_key>zip</arg_key>\n<arg_value>01234</arg_value>\n<arg_key>n</arg_key>\n"
              "<arg_value>7</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[\"a\"]</arg_value>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=zip>\n01234\n</parameter>\n<parameter=n>\n7\n"
                    "</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n</function>\n</tool_call>"),
])
def test_text_written_values_follow_the_tool_schema(name, text):
    """A string parameter stays a string even when it looks like a number; typed ones are read
    as JSON. Through ToolOutput, as the server runs it (streamed: the call once complete)."""
    schemas = {"f": {"zip": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array"}}}
    _, calls = get_tool_parser(name).parse(text, schemas)
    assert [json.loads(c.arguments) for c in calls] == [{"zip": "01234", "n": 7, "tags": ["a"]}]
    out = ToolOutput("auto", None, get_tool_parser(name), schemas=schemas)
    sent = [out.deltas(text[:k], False)[0] for k in range(1, len(text), 7)]
    assert not any(d for ds in sent for d in ds)                 # nothing before the call is complete
    deltas, called = out.deltas(text, True)
    assert called and json.loads(deltas[-1]["tool_calls"][0]["function"]["arguments"])["zip"] == "01234"
