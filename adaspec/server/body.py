"""Request bodies: JSON in, a validated pydantic model out, and every problem a 400 naming the field.

`parse_body` is the only entry point. Checks beyond what json.loads and pydantic do:
  * NaN / Infinity are refused (not JSON; a NaN temperature would pass every range check);
  * nesting deeper than MAX_JSON_DEPTH, arrays longer than the caller's `max_array_len`, and
    strings or keys holding a lone UTF-16 surrogate are refused before validation
    (`check_json_shape`, iterative so hostile input cannot overflow the stack);
  * pydantic's errors become one message per field, without its union-member tags;
  * fields no model reads are ignored, each named once in a warning (`_log_unknown`).
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from adaspec.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, FunctionDef,
                                     NamedFunction, NamedToolChoice, StreamOptions, TextPart, Tool, ToolCall,
                                     ToolCallFunction)

logger = logging.getLogger("adaspec.server")

MAX_JSON_DEPTH = 32                      # request bodies are a few levels deep; thousands is an attack
_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone one: JSON lets "\ud800" through, UTF-8 cannot hold it

_FIELD_NAMES = {name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions,
                                   Tool, FunctionDef, ToolCall, ToolCallFunction, NamedToolChoice, NamedFunction)
                for name in model.model_fields}


def _error_path(loc, names: set[str] | frozenset = frozenset()) -> str:
    """Dotted field path of a pydantic error, without pydantic's union-member tags ('int',
    'list[str]'); `names`: field names beyond the chat and completions models'."""
    return ".".join(str(x) for x in loc if isinstance(x, int) or x in _FIELD_NAMES or x in names)


def check_json_shape(data: Any, max_array_len: int) -> None:
    """400 for what json.loads lets through but no request may hold: nesting deeper than
    MAX_JSON_DEPTH, arrays longer than `max_array_len`, strings (keys too) with a lone UTF-16
    surrogate (they cannot be encoded, so the tokenizer or the response would fail). Iterative:
    a recursive walk would itself overflow on hostile input."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                raise APIError(f"{path or 'body'}: contains a lone UTF-16 surrogate, which is not valid "
                               f"Unicode", param=path or None)
        elif isinstance(value, list):
            if len(value) > max_array_len:
                raise APIError(f"{path or 'body'}: {len(value)} items exceed the limit of {max_array_len}",
                               param=path or None)
            stack.extend((v, f"{path}.{i}" if path else str(i), depth + 1) for i, v in enumerate(value)
                         if isinstance(v, (str, list, dict)))
        elif isinstance(value, dict):
            for k, v in value.items():
                key = f"{path}.{k}" if path else k
                if not k.isascii() and _SURROGATE.search(k):
                    raise APIError("a field name contains a lone UTF-16 surrogate, which is not valid Unicode")
                if isinstance(v, (str, list, dict)):
                    stack.append((v, key, depth + 1))


def parse_body(raw_body: bytes, model: type[BaseModel], max_array_len: int = 1 << 20) -> BaseModel:
    """Parse and validate a JSON body; any problem is a 400 naming the offending field."""
    def reject_constant(name: str):
        raise ValueError(f"{name} is not a valid JSON number")

    try:
        # NaN / Infinity are not JSON, and a NaN temperature would pass every range check.
        data = json.loads(raw_body, parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    check_json_shape(data, max_array_len)
    _log_unknown(data, model)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        names = set(model.model_fields)
        path = _error_path(errors[0]["loc"], names)
        deepest = _furthest_union_member(errors, names)
        if deepest is not None:
            # One member of a union (e.g. prompt: a list of token ids) matched further than the
            # others: its error is the real problem ("prompt.1: ... valid integer, got 2.5"),
            # not the first member's ("Input should be a valid string").
            raise APIError(f"{_error_path(deepest['loc'], names)}: {deepest['msg']}{_got(deepest)}",
                           param=path or None) from None
        # A union field fails once per member type; say it once, with every expectation.
        msgs = list(dict.fromkeys(err["msg"] for err in errors if _error_path(err["loc"], names) == path))
        if errors[0]["type"] == "missing":
            msgs = ["field required"]
        raise APIError(f"{path or 'body'}: {'; or '.join(msgs)}", param=path or None) from None


_logged_unknown: set[str] = set()


def _log_unknown(data: dict, model: type[BaseModel]) -> None:
    """Fields a request body holds that adaspec does not read are ignored (clients send vendor
    extras): a warning names each the first time it is seen, as vLLM logs them."""
    new = sorted(k for k in data if k not in model.model_fields and k not in _logged_unknown)
    if new and len(_logged_unknown) < 1024:
        _logged_unknown.update(new)
        logger.warning("request fields ignored (not read by adaspec; logged once each): %s", ", ".join(new))


def _furthest_union_member(errors: list[dict], names: set[str] | frozenset = frozenset()) -> dict | None:
    """The first error of the union member whose list got furthest (the highest index of its
    first failing item) when that member is the only one to get so far; else None."""
    first_loc = errors[0]["loc"]
    tag_at = next((i for i, x in enumerate(first_loc) if isinstance(x, str) and x not in _FIELD_NAMES
                   and x not in names), None)
    if tag_at is None:
        return None
    reached: dict[str, tuple[int, dict]] = {}
    for err in errors:
        loc = err["loc"]
        if len(loc) <= tag_at or loc[:tag_at] != first_loc[:tag_at]:
            continue
        member = loc[tag_at]
        index = loc[tag_at + 1] if len(loc) > tag_at + 1 and isinstance(loc[tag_at + 1], int) else -1
        if member not in reached or index < reached[member][0]:
            reached[member] = (index, err)
    if not reached:
        return None
    best = max(index for index, _ in reached.values())
    winners = [err for index, err in reached.values() if index == best]
    return winners[0] if best >= 0 and len(winners) == 1 else None


def _got(err: dict) -> str:
    value = err.get("input")
    if isinstance(value, (bool, int, float)) or value is None or (isinstance(value, str) and len(value) <= 40):
        return f", got {json.dumps(value)}"
    return ""
