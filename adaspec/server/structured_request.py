"""A request's output constraint from the fields clients send, as one `StructuredOutput` (or
None), and what its tools ask for. Every problem is a 400 naming the field.

    response_format     {"type": "text"} | {"type": "json_object"} |
                        {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs  vLLM: {"json": schema} | {"regex": r} | {"choice": [..]} |
                        {"grammar": ebnf} | {"json_object": true}
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older spelling
    tool_choice         "required": a JSON array of calls [{"name", "parameters"}] (one when
                        parallel_tool_calls is false); a named function: its parameters' JSON.
                        "auto" parses calls out of free text (server/tool_parsers.py); "none"
                        leaves the text alone.
At most one of them may constrain a request. JSON is strict: a schema's `strict: false` is
still enforced as written (a stricter answer is still a valid one).
"""
from __future__ import annotations

import json

from adaspec.server.protocol import APIError, ChatCompletionRequest
from adaspec.structured import StructuredOutput

_SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json"}


def _spec(kind: str, value, param: str) -> StructuredOutput:
    try:
        if kind == "json_schema":
            return StructuredOutput.json_schema(value if isinstance(value, (str, dict, bool)) else _bad(param))
        if kind == "choice":
            return StructuredOutput.choice(value) if isinstance(value, list) else _bad(param)
        if kind == "json":
            return StructuredOutput("json")
        return StructuredOutput(kind, value if isinstance(value, str) else _bad(param))
    except ValueError as e:
        raise APIError(f"{param}: {e}", param=param) from None


def _bad(param: str):
    raise ValueError("has the wrong type")


def _from_response_format(rf: dict) -> StructuredOutput | None:
    t = rf.get("type", "text")
    if t == "text":
        return None
    if t == "json_object":
        return StructuredOutput("json")
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise APIError("response_format.json_schema.schema: field required", param="response_format")
        return _spec("json_schema", js["schema"], "response_format.json_schema.schema")
    raise APIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {t!r}",
                   param="response_format")


def _from_structured_outputs(so: dict) -> StructuredOutput | None:
    unknown = [k for k in so if k not in _SO_KINDS and so[k] not in (None, False)]
    if unknown:
        raise APIError(f"structured_outputs.{unknown[0]} is not supported (supported: {sorted(_SO_KINDS)})",
                       param=f"structured_outputs.{unknown[0]}")
    given = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise APIError(f"structured_outputs: set one of {given}, not several", param="structured_outputs")
    if not given:
        return None
    k = given[0]
    return _spec(_SO_KINDS[k], so[k], f"structured_outputs.{k}")


def structured_of(req) -> tuple[StructuredOutput | None, str | None]:
    """(the request's constraint, the field it came from) from its structured-output fields."""
    if req.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise APIError(f"guided_decoding_backend {req.guided_decoding_backend!r} is not available: adaspec "
                       f"uses xgrammar", param="guided_decoding_backend")
    if req.guided_whitespace_pattern is not None:
        raise APIError("guided_whitespace_pattern is not supported (JSON is generated without free whitespace)",
                       param="guided_whitespace_pattern")
    found = []
    if req.response_format is not None:
        s = _from_response_format(req.response_format)
        if s is not None:
            found.append(("response_format", s))
    if req.structured_outputs is not None:
        s = _from_structured_outputs(req.structured_outputs)
        if s is not None:
            found.append(("structured_outputs", s))
    for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            found.append((field, _spec(kind, value, field)))
    if len(found) > 1:
        raise APIError(f"{found[0][0]} and {found[1][0]} both constrain the output; send one",
                       param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


class GrammarCheck:
    """Compiles a request's constraint in the server process too (cached per value), so one
    that does not compile is a 400 here rather than a failed request in the engine."""

    def __init__(self, tokenizer, aengine):
        self.tokenizer, self.aengine, self.cache = tokenizer, aengine, None

    def __call__(self, structured: StructuredOutput | None, field: str) -> None:
        if structured is None:
            return
        if self.aengine.config.tensor_parallel_size > 1:
            from adaspec.engine.grammar_step import TP_UNSUPPORTED
            raise APIError(f"{field}: {TP_UNSUPPORTED}", param=field)
        if self.cache is None:
            if self.tokenizer is None:
                raise APIError(f"{field}: structured outputs need the model's tokenizer", param=field)
            from adaspec.structured.grammar import GrammarCache

            eos = getattr(self.aengine, "eos_token_ids", None) or [self.tokenizer.eos_token_id or 0]
            self.cache = GrammarCache.from_tokenizer(self.tokenizer, self.aengine.vocab_size, list(eos))
        try:
            self.cache.compile(structured)
        except ValueError as e:
            raise APIError(f"{field}: {e}", param=field) from None


# ---- tools -----------------------------------------------------------------------------------
def tool_mode(req: ChatCompletionRequest) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return "none", None
    if choice is None or isinstance(choice, str):
        return choice or "auto", None
    names = [t.function.name for t in req.tools]
    if choice.function.name not in names:
        raise APIError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools",
                       param="tool_choice")
    return "named", choice.function.name


def _parameters(tool) -> dict:
    p = tool.function.parameters
    return p if p else {"type": "object", "properties": {}}


def tool_grammar(req: ChatCompletionRequest, mode: str, name: str | None) -> StructuredOutput | None:
    """The constraint that enforces tool_choice "required" or a named function."""
    if mode == "named":
        tool = next(t for t in req.tools if t.function.name == name)
        return _spec("json_schema", _parameters(tool), "tools")
    if mode != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)}}
             for t in req.tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return _spec("json_schema", schema, "tools")


def calls_of_forced(text: str, mode: str, name: str | None):
    """The tool calls of an output generated under `tool_grammar` (the grammar made it parse;
    a truncated one, finish_reason "length", yields what is complete)."""
    from adaspec.server.tool_parsers import ParsedCall

    try:
        value = json.loads(text)
    except ValueError:
        return []
    if mode == "named":
        return [ParsedCall(name, json.dumps(value, ensure_ascii=False))]
    return [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
