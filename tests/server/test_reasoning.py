"""`--reasoning-parser`: a chat answer's <think> text goes to reasoning_content, the rest to
content (tools read from the rest only), whole and streamed alike."""
from __future__ import annotations

import json

import httpx
import pytest

from adaspec.server.chat_tools import ToolOutput
from adaspec.server.reasoning import get_reasoning_parser
from adaspec.server.tool_parsers import get_tool_parser

THINK = "<think>\nSum them.\n2 + 2 = 4.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize("name,text,prompt_opened,want", [
    ("qwen3", THINK, False, ("Sum them.\n2 + 2 = 4.", "The answer is 4.")),
    ("qwen3", "The answer is 4.", False, ("", "The answer is 4.")),            # enable_thinking=False
    ("qwen3", "Sum them.</think>\n\nFour.", True, ("Sum them.", "Four.")),     # the prompt opened <think>
    ("deepseek_r1", "Sum them.</think>\n\nFour.", False, ("Sum them.", "Four.")),
    ("deepseek_r1", THINK, False, ("Sum them.\n2 + 2 = 4.", "The answer is 4.")),
    ("glm45", "<think>cut off", False, ("cut off", "")),                           # never closed
])
def test_split_whole_and_streamed(name, text, prompt_opened, want):
    p = get_reasoning_parser(name)
    assert p.split(text, True, prompt_opened) == want
    out = ToolOutput("none", None, None, reasoning=p, prompt_opened=prompt_opened)
    deltas = [d for k in range(1, len(text) + 1) for d in out.deltas(text[:k], k == len(text))[0]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == want[0]
    assert "".join(d.get("content", "") for d in deltas) == want[1]
    assert all(len(d) == 1 for d in deltas)


def test_tools_are_read_after_the_reasoning():
    text = '<think>I should call f. <tool_call>not this</think>\n\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    out = ToolOutput("auto", None, get_tool_parser("hermes"), reasoning=get_reasoning_parser("qwen3"))
    msg, called = out.message(type("O", (), {"text": text, "token_ids": []})())
    assert called and msg["reasoning_content"] == "I should call f. <tool_call>not this"
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"x": 1}]


def test_reasoning_parser_over_http(tok_model_dir, tok_head_dir):
    """A grammar makes the tiny model write a think block; the answer comes split, streamed too."""
    from server_helpers import MODEL_NAME, ServerProcess

    srv = ServerProcess(["--model", tok_model_dir, "--draft", tok_head_dir, "--speculation", "always",
                         "--num-kv-blocks", "128", "--max-model-len", "256", "--reasoning-parser", "qwen3"])
    try:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                "temperature": 0, "structured_outputs": {"regex": "<think>[a-z]{3,6}</think>\\n\\nok [a-z]{2}"}}
        msg = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert 3 <= len(msg["reasoning_content"]) <= 6 and msg["content"].startswith("ok ")
        whole = httpx.post(srv.url + "/v1/chat/completions", json={**body, "logprobs": True}, timeout=60).json()
        events = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": True, "logprobs": True},
                            timeout=60).text
        choices = [json.loads(line[6:])["choices"][0] for line in events.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        deltas = [c["delta"] for c in choices]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
        streamed = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["content"]]
        assert len(streamed) == whole["usage"]["completion_tokens"] == len(whole["choices"][0]["logprobs"]["content"])
    finally:
        code, out = srv.stop()
    assert code == 0, out
