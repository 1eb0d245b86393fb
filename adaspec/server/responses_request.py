"""The Responses API's request body (`ResponsesRequest`) and the chat request that serves it
(`to_chat`): `instructions` become a system message, `input` items chat messages, function
tools chat tools. Every problem is a 400 naming the Responses field.

    input items   {"role", "content": str | [{"type": "input_text" | "output_text", "text"}]}
                  ("type": "message" optional);
                  {"type": "function_call", "call_id", "name", "arguments"} (an earlier call: an
                  assistant turn with tool_calls; consecutive calls share one);
                  {"type": "function_call_output", "call_id", "output"} (a tool turn)
    tools         [{"type": "function", "name", "description", "parameters", "strict"}]
    tool_choice   "none" | "auto" | "required" | {"type": "function", "name"}
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, StrictBool, StrictStr, ValidationError

from adaspec.server.protocol import APIError, ChatCompletionRequest, FunctionDef, Int64, Number, Seed, _Strict


class InputPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: StrictStr


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[InputPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr = ""
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


InputItem = Annotated[Union[FunctionCallItem, FunctionCallOutputItem, InputMessage], Field(union_mode="left_to_right")]


class FunctionTool(FunctionDef):
    """A Responses function tool: chat's function definition, flat, with its type."""

    type: Literal["function"]


class NamedChoice(_Strict):
    type: Literal["function"]
    name: StrictStr


class ResponsesRequest(_Strict):
    model: StrictStr | None = None
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: Int64 | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: Seed | None = None
    stream: StrictBool = False
    store: StrictBool = True
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: StrictBool = True
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    background: StrictBool = False
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: Int64 | None = None

    def unsupported(self) -> tuple[str, str] | None:
        for field, why in (("previous_response_id", "responses are not stored"),
                           ("conversation", "conversations are not stored"),
                           ("background", "background responses are not supported"),
                           ("prompt", "prompt templates are not supported"),
                           ("top_logprobs", "logprobs are served by /v1/chat/completions")):
            if getattr(self, field):
                return field, f"{field} is not supported here: {why}"
        if self.reasoning and self.reasoning.get("effort") is not None:
            return "reasoning", "reasoning effort is not supported"
        if self.truncation == "auto":
            return "truncation", "truncation 'auto' is not supported (a prompt that does not fit is a 400)"
        return None


def _response_format(fmt: dict | None) -> dict | None:
    """text.format -> chat's response_format."""
    if not fmt or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return dict(fmt)


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(f"tools.{i}: only function tools are supported, got type {t.get('type')!r}",
                           param="tools")
        try:
            f = FunctionTool.model_validate(t)
        except ValidationError as e:
            raise APIError(f"tools.{i}: {e.errors()[0]['msg']}", param="tools") from None
        out.append({"type": "function", "function": f.model_dump(exclude={"type"}, exclude_none=True)})
    return out


def _messages(req: ResponsesRequest) -> list[dict]:
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for item in req.input:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            messages.append({"role": item.role, "content": item.text()})
    return messages


#: chat's field names -> the Responses API's, for error messages
PARAM_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `req`; APIError naming the Responses field when it fails."""
    bad = req.unsupported()
    if bad is not None:
        raise APIError(bad[1], param=bad[0])
    choice = req.tool_choice
    if isinstance(choice, NamedChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    body = {"model": req.model, "messages": _messages(req), "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "user": req.user,
            "response_format": _response_format((req.text or {}).get("format")), "tools": _tools(req.tools),
            "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        loc = e.errors()[0]["loc"]
        field = PARAM_NAMES.get(str(loc[0]), str(loc[0])) if loc else None
        raise APIError(f"{field}: {e.errors()[0]['msg']}", param=field) from None
