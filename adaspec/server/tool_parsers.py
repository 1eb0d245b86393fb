"""Tool calls in a model's output, per family (`--tool-call-parser`, vLLM's names):

    hermes       Qwen 2.5/3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3_json  Llama 3.1+: the whole output is {"name": ..., "parameters": {...}} (several
                 separated by ";"), optionally after <|python_tag|>
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (tokenizer v3) or
                 [TOOL_CALLS]name[ARGS]{...} (v11+)
    glm45        GLM-4.5 / 4.6: <tool_call>name <arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>
    qwen3_coder  Qwen3-Coder: <tool_call><function=name><parameter=k>v</parameter>...</function></tool_call>

The last two write argument values as text: a value is read by the type its tool's JSON
schema gives the parameter (`parse(text, schemas)`; a string stays a string, "42" of an
integer parameter becomes 42), and without one as JSON where it parses, else as a string.

A parser sees the output decoded WITH special tokens (the markers are special tokens in
most of these tokenizers) and returns (content, calls): the text outside tool calls (None if
empty) and [ParsedCall]. Text that does not parse as the family's calls stays content. For
streaming, `marker_at(text)` says where calls begin (content is streamed up to there) and
`could_start(text)` whether the text's tail may still become a marker (held back).
"""
from __future__ import annotations

import abc
import json
import re
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str   # a JSON object, as OpenAI sends it

    def openai(self, index: int | None = None) -> dict:
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": index, **call} if index is not None else call


def _call(obj, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def partial_suffix(text: str, tag: str) -> int:
    """Characters at the end of `text` that could be the start of `tag` (held back by a stream)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolParser(abc.ABC):
    """One model family's tool-call format: `marker` opens a call in the output text."""

    name = ""
    marker = ""

    @abc.abstractmethod
    def parse(self, text: str, schemas: dict | None = None) -> tuple[str | None, list[ParsedCall]]:
        """(content: the text outside the calls, None when empty; the calls). Text that does not
        parse as calls is all content, with no calls. `schemas`: {tool name: its parameters'
        JSON-schema properties}, for formats that write values as text."""

    def marker_at(self, text: str) -> int:
        return text.find(self.marker)

    def could_start(self, text: str) -> int:
        """Characters at the end of `text` that could be the start of the marker."""
        return partial_suffix(text, self.marker)


class HermesParser(ToolParser):
    name, marker = "hermes", "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text, schemas=None):
        at = text.find(self.marker)
        if at < 0:
            return (text or None), []
        calls = []
        for body in self._CALL.findall(text[at:]):
            try:
                c = _call(json.loads(body), "arguments")
            except ValueError:
                c = None
            if c is None:
                return (text or None), []
            calls.append(c)
        return (text[:at].strip() or None), calls


class Llama3JsonParser(ToolParser):
    name, marker = "llama3_json", "<|python_tag|>"

    def parse(self, text, schemas=None):
        body = text.replace(self.marker, "").strip()
        if not body.startswith("{"):
            return (text or None), []
        calls, dec, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, end = dec.raw_decode(body, i)
            except ValueError:
                return (text or None), []
            c = _call(obj, "parameters")
            if c is None:
                return (text or None), []
            calls.append(c)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def marker_at(self, text):
        at = text.find(self.marker)
        if at >= 0:
            return at
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else -1

    def could_start(self, text):
        if not text.strip():   # nothing yet: a call may still begin
            return len(text)
        return super().could_start(text)


class MistralParser(ToolParser):
    name, marker = "mistral", "[TOOL_CALLS]"

    def parse(self, text, schemas=None):
        at = text.find(self.marker)
        if at < 0:
            return (text or None), []
        content = text[:at].strip() or None
        rest = text[at + len(self.marker):].strip()
        calls = []
        if rest.startswith("["):
            try:
                items = json.loads(rest)
            except ValueError:
                return (text or None), []
            calls = [_call(o, "arguments") for o in (items if isinstance(items, list) else [items])]
        else:   # v11+: name[ARGS]{...} per call, each after its own [TOOL_CALLS]
            for part in text[at:].split(self.marker)[1:]:
                name, sep, args = part.partition("[ARGS]")
                try:
                    calls.append(_call({"name": name.strip(), "arguments": json.loads(args)}, "arguments")
                                 if sep else None)
                except ValueError:
                    calls.append(None)
        if not calls or any(c is None for c in calls):
            return (text or None), []
        return content, calls


def _typed(raw: str, ptype) -> object:
    """A text-written argument value as its schema type (see the module docstring)."""
    types = ptype if isinstance(ptype, list) else [ptype] if ptype else []
    if "string" in types:
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if types or not isinstance(value, str) else raw


class _TextArgsParser(ToolParser):
    """Formats that write each call's name and arguments as tagged text inside <tool_call>."""

    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    @abc.abstractmethod
    def _name_and_args(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        """(name, [(key, raw value)]) of one call's body, or None if it is not one."""

    def parse(self, text, schemas=None):
        at = text.find(self.marker)
        if at < 0:
            return (text or None), []
        bodies = self._CALL.findall(text[at:])
        calls = []
        for body in bodies:
            got = self._name_and_args(body)
            if got is None or not got[0]:
                return (text or None), []
            name, pairs = got
            props = ((schemas or {}).get(name) or {})
            args = {k: _typed(v, (props.get(k) or {}).get("type")) for k, v in pairs}
            calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls or text[at:].count(self.marker) != len(calls):   # an unclosed call is not one
            return (text or None), []
        return (text[:at].strip() or None), calls


class Glm45Parser(_TextArgsParser):
    name = "glm45"
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def _name_and_args(self, body):
        name = body.split("<arg_key>", 1)[0].strip()
        if "\n" in name or "<" in name:
            return None
        return name, [(k.strip(), v) for k, v in self._ARG.findall(body)]


class Qwen3CoderParser(_TextArgsParser):
    name = "qwen3_coder"
    _FUNC = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def _name_and_args(self, body):
        m = self._FUNC.match(body)
        if m is None:
            return None
        return m.group(1).strip(), [(k.strip(), v) for k, v in self._PARAM.findall(m.group(2))]


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                                  Glm45Parser, Qwen3CoderParser)}
# The parser a model family uses when --tool-call-parser is not given (config.json model_type).
FAMILY_PARSERS = {"llama": "llama3_json", "qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                  "mistral": "mistral", "mixtral": "mistral", "glm4_moe": "glm45"}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
