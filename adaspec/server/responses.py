"""OpenAI's Responses API (`POST /v1/responses`), served through the chat path: the input
becomes chat messages (`instructions` first, as a system message), the answer is one assistant
message of `output_text`, and speculation, sampling and structured output work as for chat.

    input               a string (one user message) or a list of messages
                        {"role", "content": str | [{"type": "input_text" | "output_text", "text"}]}
                        ("type": "message" optional)
    instructions        a system message before the input
    max_output_tokens   max_completion_tokens; a cut answer is status "incomplete" with
                        incomplete_details.reason "max_output_tokens"
    temperature, top_p, seed, user, metadata (echoed), store (nothing is stored),
    text.format         {"type": "text" | "json_object"} or {"type": "json_schema", "name", "schema", "strict"}
    stream              the Responses events: response.created, response.in_progress,
                        response.output_item.added, response.content_part.added,
                        response.output_text.delta ..., response.output_text.done,
                        response.content_part.done, response.output_item.done, then
                        response.completed (or response.incomplete / response.failed)

Refused by name (a 400): tools and tool calls in the input, previous_response_id and
conversation (nothing is stored), background, prompt templates, reasoning effort, top_logprobs.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, StrictBool, StrictStr, ValidationError
from starlette.background import BackgroundTask

from adaspec.engine.request import RequestOutput
from adaspec.server.body import parse_body
from adaspec.server.protocol import APIError, ChatCompletionRequest, Int64, Number, Seed, _Strict
from adaspec.server.request_stream import EngineError
from adaspec.server.streaming import _SSE_ESCAPES


class InputPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: StrictStr


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[InputPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponsesRequest(_Strict):
    model: StrictStr | None = None
    input: StrictStr | list[InputMessage] = Field(min_length=1)
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
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool = True
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    background: StrictBool = False
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: Int64 | None = None

    def unsupported(self) -> tuple[str, str] | None:
        for field, why in (("tools", "tools are served by /v1/chat/completions"),
                           ("previous_response_id", "responses are not stored"),
                           ("conversation", "conversations are not stored"),
                           ("background", "background responses are not supported"),
                           ("prompt", "prompt templates are not supported"),
                           ("top_logprobs", "logprobs are served by /v1/chat/completions")):
            if getattr(self, field):
                return field, f"{field} is not supported here: {why}"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool_choice is not supported here: tools are served by /v1/chat/completions"
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


_PARAM_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                "messages": "input"}


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `req`; APIError naming the Responses field when it fails."""
    bad = req.unsupported()
    if bad is not None:
        raise APIError(bad[1], param=bad[0])
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        messages += [{"role": m.role, "content": m.text()} for m in req.input]
    body = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "user": req.user,
            "response_format": _response_format((req.text or {}).get("format"))}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        loc = e.errors()[0]["loc"]
        field = _PARAM_NAMES.get(str(loc[0]), str(loc[0])) if loc else None
        raise APIError(f"{field}: {e.errors()[0]['msg']}", param=field) from None


def _usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


class ResponseBuilder:
    """The `response` object at each stage, and the message item inside it."""

    def __init__(self, req: ResponsesRequest, model: str, role: str):
        self.req, self.model, self.role = req, model, role
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def message(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
            else []
        return {"type": "message", "id": self.item_id, "status": status, "role": self.role, "content": content}

    def response(self, status: str, out: RequestOutput | None = None, error: str | None = None) -> dict:
        r = self.req
        fmt = (r.text or {}).get("format") or {"type": "text"}
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None if error is None else {"code": "server_error", "message": error},
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
                "output": [], "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": r.temperature, "text": {"format": fmt}, "tool_choice": "auto", "tools": [],
                "top_p": r.top_p, "truncation": r.truncation, "usage": None, "user": r.user,
                "metadata": r.metadata or {}}
        if out is not None:
            item_status = "completed" if status == "completed" else "incomplete"
            body["output"] = [self.message(out.text or "", item_status)]
            body["usage"] = _usage(out)
        return body


def _final_status(out: RequestOutput) -> str:
    return {"stop": "completed", "length": "incomplete"}.get(out.finish_reason or "", "failed")


async def responses(serving, body: bytes, raw: Request) -> Response:
    """POST /v1/responses on `serving` (an OpenAIServing)."""
    def prepare(b: bytes):
        req = parse_body(b, ResponsesRequest, serving.max_array_len)
        chat = to_chat(req)
        try:
            return req, chat, serving.prepare_chat(chat)
        except APIError as e:   # named as the Responses API names them
            if e.param in _PARAM_NAMES:
                old, e.param = e.param, _PARAM_NAMES[e.param]
                e.message = e.message.replace("max_tokens" if old == "max_completion_tokens" else old, e.param)
            raise

    req, chat, prepared = await serving.off_loop(prepare, body)
    build = ResponseBuilder(req, req.model or serving.settings.served_model_name, serving.settings.response_role)
    streams = await serving.submit(build.id, prepared)
    if req.stream:
        return _stream(serving, streams, build)
    finals = await serving.collect(streams, raw)
    if finals is None:
        return Response(status_code=499)
    out = finals[0]
    status = _final_status(out)
    return JSONResponse(build.response(status, out, error="the request was aborted" if status == "failed" else None))


def _sse(event: dict) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":")).translate(_SSE_ESCAPES)
    return f"event: {event['type']}\ndata: {data}\n\n"


def _stream(serving, streams, build: ResponseBuilder) -> StreamingResponse:
    seq = iter(range(1 << 62))
    complete = False

    def event(kind: str, **fields) -> str:
        return _sse({"type": kind, "sequence_number": next(seq), **fields})

    async def body() -> AsyncIterator[str]:
        nonlocal complete
        at = {"item_id": build.item_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=build.response("in_progress"))
        yield event("response.in_progress", response=build.response("in_progress"))
        yield event("response.output_item.added", output_index=0, item=build.message("", "in_progress"))
        yield event("response.content_part.added", **at,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        text, final = "", None
        try:
            async for _, out in serving.merge(streams):
                if out.new_text:
                    text += out.new_text
                    yield event("response.output_text.delta", **at, delta=out.new_text, logprobs=[])
                if out.finished:
                    final = out
        except EngineError as e:
            serving.metrics.on_rejected("engine_error")
            yield event("response.failed", response=build.response("failed", error=str(e)))
            complete = True
            return
        status = _final_status(final)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield event("response.output_text.done", **at, text=text, logprobs=[])
        yield event("response.content_part.done", **at, part=part)
        item_status = "completed" if status == "completed" else "incomplete"
        yield event("response.output_item.done", output_index=0, item=build.message(text, item_status))
        done = build.response(status, final, error="the request was aborted" if status == "failed" else None)
        yield event({"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed"), response=done)
        complete = True

    def cleanup() -> None:
        if not complete:
            serving.metrics.on_disconnect("stream")
        serving.abort_unfinished(streams)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(cleanup))
