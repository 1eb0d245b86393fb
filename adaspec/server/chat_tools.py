"""Chat requests with tools, both ways.

In: `chat_messages` turns the request's messages into what chat templates read (assistant
`tool_calls` with their arguments as objects, as Hugging Face templates expect; `tool` turns
with their `tool_call_id`), and `template_kwargs` adds the tool definitions and the template
switches (add_generation_prompt, continue_final_message, chat_template_kwargs).

Out: `ToolOutput` turns a choice's generated text into the assistant message (content and
`tool_calls`, finish_reason "tool_calls" when it called any) and, streaming, into OpenAI
deltas. Content streams as it comes until a tool call may have begun (the parser's marker);
calls are sent once complete, each as one delta with its id, name and arguments. Under
tool_choice "named" the output is the function's arguments, streamed as they come.
"""
from __future__ import annotations

import json
from pathlib import Path

from adaspec.server.reasoning import ReasoningParser
from adaspec.server.protocol import APIError, ChatCompletionRequest
from adaspec.server.structured_request import calls_of_forced
from adaspec.server.tool_parsers import FAMILY_PARSERS, ToolParser

RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
                            "return_dict", "conversation")


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for m in req.messages:
        d: dict = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args = json.loads(c.function.arguments) if c.function.arguments else {}
                except ValueError:
                    args = c.function.arguments
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def template_kwargs(req: ChatCompletionRequest) -> dict:
    extra = dict(req.chat_template_kwargs or {})
    bad = [k for k in extra if k in RESERVED_TEMPLATE_KWARGS]
    if bad:
        raise APIError(f"chat_template_kwargs.{bad[0]} is set by the request itself, not here",
                       param=f"chat_template_kwargs.{bad[0]}")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError("continue_final_message needs add_generation_prompt: false", param="continue_final_message")
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise APIError("continue_final_message needs an assistant message last", param="continue_final_message")
    kw = {**extra, "add_generation_prompt": req.add_generation_prompt}
    if req.continue_final_message:
        kw["continue_final_message"] = True
    if req.tools:
        kw["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    return kw


def default_parser_name(model_dir: str | None) -> str:
    """The tool-call parser of the model's family (config.json model_type); hermes otherwise."""
    try:
        mt = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError, TypeError):
        mt = ""
    return FAMILY_PARSERS.get(mt, "hermes")


class ToolOutput:
    """One choice's output under `mode` ("none" | "auto" | "required" | "named")."""

    def __init__(self, mode: str, name: str | None, parser: ToolParser | None, tokenizer=None,
                 eos: set[int] = frozenset(), schemas: dict | None = None,
                 reasoning: ReasoningParser | None = None, prompt_opened: bool = False):
        self.mode, self.name, self.parser = mode, name, parser
        self.schemas = schemas   # {tool name: its parameters' schema properties} (ToolParser.parse)
        self.tokenizer, self.eos = tokenizer, eos   # for "auto": the text with special tokens
        # --reasoning-parser: the answer's <think> part goes to reasoning_content, and tools are
        # read out of the rest (`prompt_opened`: the prompt ends inside <think>)
        self.reasoning, self.prompt_opened = reasoning, prompt_opened
        self.sent = 0            # characters of content (named: of arguments) already streamed
        self.sent_reasoning = 0
        self.named_started = False

    @property
    def active(self) -> bool:
        return self.mode != "none" or self.reasoning is not None

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, the rest) of the answer so far."""
        if self.reasoning is None:
            return "", text
        return self.reasoning.split(text, finished, self.prompt_opened)

    def text(self, out, finished: bool) -> str:
        """The output as the parser reads it. "auto": decoded WITH special tokens (markers such
        as [TOOL_CALLS] are special), the stop token left out; else the engine's text."""
        if self.mode != "auto" or self.tokenizer is None:
            return out.text or ""
        text = self.tokenizer.decode([t for t in out.token_ids if t not in self.eos], skip_special_tokens=False)
        return text if finished else text.rstrip("\ufffd")

    def message(self, out) -> tuple[dict, bool]:
        """(the assistant message, whether it called tools) of a complete output."""
        reasoning, rest = self.split(self.text(out, True), True)
        content, calls = self._parse(rest)
        msg: dict = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning or None
        if calls:
            msg["tool_calls"] = [c.openai() for c in calls]
        elif content is None:
            msg["content"] = ""
        return msg, bool(calls)

    def _parse(self, text: str):
        if self.mode in ("required", "named"):
            return None, calls_of_forced(text, self.mode, self.name)
        if self.mode == "auto" and self.parser is not None:
            return self.parser.parse(text, self.schemas)
        return text, []

    def chunks(self, base: dict, index: int, out, finish: str | None, logprobs: dict | None = None) -> list[dict]:
        """The stream chunks of choice `index` for engine output `out` (none: nothing to send yet);
        `logprobs`: those of the output's new tokens, sent with its first chunk."""
        deltas, called = self.deltas(self.text(out, out.finished), out.finished)
        if called and finish == "stop":
            finish = "tool_calls"
        if not deltas and not out.finished and not logprobs:
            return []
        deltas = deltas or [{}]
        last = len(deltas) - 1
        return [{**base, "choices": [{"index": index, "delta": d, "logprobs": logprobs if k == 0 else None,
                                      "finish_reason": finish if k == last else None,
                                      "stop_reason": getattr(out, "stop_reason", None) if k == last and finish else None}]}
                for k, d in enumerate(deltas)]

    def deltas(self, text: str, finished: bool) -> tuple[list[dict], bool]:
        """(the deltas that `text`, the output so far, adds, whether tools were called)."""
        reasoning, text = self.split(text, finished)
        out: list[dict] = []
        if len(reasoning) > self.sent_reasoning:
            out.append({"reasoning_content": reasoning[self.sent_reasoning:]})
            self.sent_reasoning = len(reasoning)
        more, called = self._content_deltas(text, finished)
        return out + more, called

    def _content_deltas(self, text: str, finished: bool) -> tuple[list[dict], bool]:
        if self.mode == "none":
            new = text[self.sent:]
            self.sent = len(text)
            return ([{"content": new}] if new else []), False
        if self.mode == "named":
            out = []
            if not self.named_started:
                self.named_started = True
                out.append({"tool_calls": [{"index": 0, "id": f"call_{_hex()}", "type": "function",
                                            "function": {"name": self.name, "arguments": ""}}]})
            if len(text) > self.sent:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text[self.sent:]}}]})
                self.sent = len(text)
            return out, True
        if self.mode == "required":
            if not finished:
                return [], False
            calls = calls_of_forced(text, self.mode, self.name)
            return [{"tool_calls": [c.openai(i) for i, c in enumerate(calls)]}] if calls else [], bool(calls)
        # auto: content up to where a call may begin; the calls once the output is complete
        at = self.parser.marker_at(text)
        upto = at if at >= 0 else len(text) - (0 if finished else self.parser.could_start(text))
        out = []
        if finished and at >= 0:
            content, calls = self.parser.parse(text, self.schemas)
            if not calls:   # not a call after all: it is content
                upto = len(text)
        if upto > self.sent:
            out.append({"content": text[self.sent:upto]})
            self.sent = upto
        if finished and at >= 0 and calls:
            out.append({"tool_calls": [c.openai(i) for i, c in enumerate(calls)]})
            return out, True
        return out, False


def _hex() -> str:
    import secrets

    return secrets.token_hex(12)
