"""OpenAI's Responses API (`POST /v1/responses`), served through the chat path
(`responses_request.to_chat`): speculation, sampling, structured output, tools and the
reasoning parser work as for chat. The answer is output items: a `reasoning` item (with
`--reasoning-parser`), a `message` of `output_text`, then one `function_call` per tool call.

    instructions, input (text, messages, earlier function calls and their outputs), tools,
    tool_choice, parallel_tool_calls, max_output_tokens (a cut answer is status "incomplete",
    incomplete_details.reason "max_output_tokens"), temperature, top_p, seed, user, metadata
    (echoed), store (nothing is stored), text.format ({"type": "text" | "json_object"} or
    {"type": "json_schema", "name", "schema", "strict"})
    stream   the Responses events: response.created, response.in_progress, then per item
             response.output_item.added, its parts' deltas and .done events
             (response.output_text.delta / .done in a content part for the message,
             response.function_call_arguments.delta / .done for a call), response.output_item.done;
             last response.completed (or response.incomplete / response.failed)

Refused by name (a 400): previous_response_id and conversation (nothing is stored),
background, prompt templates, reasoning effort, top_logprobs, tools other than functions.
"""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from adaspec.engine.request import RequestOutput
from adaspec.server.body import parse_body
from adaspec.server.protocol import APIError
from adaspec.server.request_stream import EngineError
from adaspec.server.responses_request import PARAM_NAMES, ResponsesRequest, to_chat
from adaspec.server.streaming import sse


def _usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


def _status(out: RequestOutput | None) -> str:
    reason = out.finish_reason if out is not None else None
    return {"stop": "completed", "length": "incomplete"}.get(reason or "", "failed")


class ResponseBuilder:
    """The `response` object at each stage, and the output items inside it."""

    def __init__(self, req: ResponsesRequest, model: str, role: str):
        self.req, self.model, self.role = req, model, role
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex}"

    def message(self, item_id: str, text: str | None, status: str) -> dict:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": item_id, "status": status, "role": self.role, "content": content}

    @staticmethod
    def reasoning(item_id: str, text: str) -> dict:
        return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
                "status": "completed"}

    @staticmethod
    def function_call(item_id: str, call: dict, status: str = "completed") -> dict:
        return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"], "status": status}

    def items(self, message: dict, status: str) -> list[dict]:
        """The output items of a whole chat message (`ToolOutput.message` / a plain one)."""
        out = []
        if message.get("reasoning_content"):
            out.append(self.reasoning(self.new_id("rs"), message["reasoning_content"]))
        if message.get("content") or not message.get("tool_calls"):
            out.append(self.message(self.new_id("msg"), message.get("content") or "",
                                    "completed" if status == "completed" else "incomplete"))
        out += [self.function_call(self.new_id("fc"), c) for c in message.get("tool_calls") or []]
        return out

    def response(self, status: str, out: RequestOutput | None = None, items: list[dict] | None = None,
                 error: str | None = None) -> dict:
        r = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None if error is None else {"code": "server_error", "message": error},
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
                "output": items or [], "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": r.temperature,
                "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
                "tool_choice": r.tool_choice if isinstance(r.tool_choice, str) else
                (r.tool_choice.model_dump() if r.tool_choice is not None else "auto"),
                "tools": r.tools or [], "top_p": r.top_p, "truncation": r.truncation,
                "usage": _usage(out) if out is not None else None, "user": r.user, "metadata": r.metadata or {}}


async def responses(serving, body: bytes, raw: Request) -> Response:
    """POST /v1/responses on `serving` (an OpenAIServing)."""
    def prepare(b: bytes):
        req = parse_body(b, ResponsesRequest, serving.max_array_len)
        chat = to_chat(req)
        try:
            return req, chat, serving.prepare_chat(chat)
        except APIError as e:   # named as the Responses API names them
            if e.param in PARAM_NAMES:
                old, e.param = e.param, PARAM_NAMES[e.param]
                e.message = e.message.replace("max_tokens" if old == "max_completion_tokens" else old, e.param)
            raise

    req, chat, prepared = await serving.off_loop(prepare, body)
    build = ResponseBuilder(req, req.model or serving.settings.served_model_name, serving.settings.response_role)
    reader = serving.tool_outputs(chat, prepared)[0]
    streams = await serving.submit(build.id, prepared)
    if req.stream:
        return _stream(serving, streams, build, reader)
    finals = await serving.collect(streams, raw)
    if finals is None:
        return Response(status_code=499)
    out = finals[0]
    status = _status(out)
    message = reader.message(out)[0] if reader.active else {"content": out.text or ""}
    return JSONResponse(build.response(status, out, build.items(message, status),
                                       error="the request was aborted" if status == "failed" else None))


def _sse(event: dict) -> str:
    """A Responses event: chat's SSE data line, named by its type."""
    return f"event: {event['type']}\n" + sse(event)


class _Events:
    """The stream's events, numbered, with the items it has opened and closed."""

    def __init__(self, build: ResponseBuilder):
        self.build, self.seq, self.items = build, 0, []
        self.reasoning = ""
        self.message: dict | None = None   # the open message item: {"id", "index", "text"}
        self.calls: dict[int, dict] = {}   # open function_call items by chat tool-call index

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return _sse({"type": kind, "sequence_number": self.seq - 1, **fields})

    def add_item(self, item: dict) -> list[str]:
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def flush_reasoning(self) -> list[str]:
        """The reasoning so far as one item, before anything else is opened."""
        if not self.reasoning:
            return []
        item = self.build.reasoning(self.build.new_id("rs"), self.reasoning)
        self.reasoning = ""
        out = self.add_item(item)
        return out + [self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def text(self, delta: str) -> list[str]:
        out = self.flush_reasoning()
        if self.message is None:
            item_id = self.build.new_id("msg")
            out += self.add_item(self.build.message(item_id, None, "in_progress"))
            self.message = {"id": item_id, "index": len(self.items) - 1, "text": ""}
            out.append(self.event("response.content_part.added", **self._at(),
                                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.message["text"] += delta
        return out + [self.event("response.output_text.delta", **self._at(), delta=delta, logprobs=[])]

    def _at(self) -> dict:
        return {"item_id": self.message["id"], "output_index": self.message["index"], "content_index": 0}

    def close_message(self, status: str) -> list[str]:
        if self.message is None:
            return []
        text, at = self.message["text"], self._at()
        item = self.build.message(self.message["id"], text, status)
        self.items[self.message["index"]] = item
        self.message = None
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return [self.event("response.output_text.done", **at, text=text, logprobs=[]),
                self.event("response.content_part.done", **at, part=part),
                self.event("response.output_item.done", output_index=at["output_index"], item=item)]

    def call_delta(self, d: dict) -> list[str]:
        """A chat tool-call delta: one with an id opens a function_call item (a whole call, or
        the start of one whose arguments follow, tool_choice naming a function); arguments
        stream as its argument deltas."""
        out = []
        if d.get("id"):
            out += self.flush_reasoning() + self.close_message("completed")
            item_id = self.build.new_id("fc")
            call = {"id": d["id"], "function": {"name": d["function"]["name"], "arguments": ""}}
            out += self.add_item(self.build.function_call(item_id, call, "in_progress"))
            self.calls[d.get("index", 0)] = {"item": item_id, "index": len(self.items) - 1, "call": call}
        open_ = self.calls.get(d.get("index", 0))
        args = (d.get("function") or {}).get("arguments") or ""
        if open_ is not None and args:
            open_["call"]["function"]["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta", item_id=open_["item"],
                                  output_index=open_["index"], delta=args))
        return out

    def close_calls(self) -> list[str]:
        out = []
        for c in self.calls.values():
            done = self.build.function_call(c["item"], c["call"])
            self.items[c["index"]] = done
            out += [self.event("response.function_call_arguments.done", item_id=c["item"], output_index=c["index"],
                               arguments=c["call"]["function"]["arguments"]),
                    self.event("response.output_item.done", output_index=c["index"], item=done)]
        self.calls = {}
        return out


def _stream(serving, streams, build: ResponseBuilder, reader) -> StreamingResponse:
    ev = _Events(build)
    complete = False

    def from_deltas(deltas: list[dict]) -> list[str]:
        out = []
        for d in deltas:
            ev.reasoning += d.get("reasoning_content") or ""
            if d.get("content"):
                out += ev.text(d["content"])
            for call in d.get("tool_calls") or []:
                out += ev.call_delta(call)
        return out

    async def body() -> AsyncIterator[str]:
        nonlocal complete
        yield ev.event("response.created", response=build.response("in_progress"))
        yield ev.event("response.in_progress", response=build.response("in_progress"))
        final = None
        try:
            async for _, out in serving.merge(streams):
                if reader.active:
                    deltas = reader.deltas(reader.text(out, out.finished), out.finished)[0]
                else:
                    deltas = [{"content": out.new_text}] if out.new_text else []
                for e in from_deltas(deltas):
                    yield e
                if out.finished:
                    final = out
        except EngineError as e:
            serving.metrics.on_rejected("engine_error")
            yield ev.event("response.failed", response=build.response("failed", error=str(e)))
            complete = True
            return
        status = _status(final)
        if not ev.items and ev.message is None and not ev.reasoning:
            for e in ev.text(""):   # an empty answer is still one (empty) message
                yield e
        for e in ev.flush_reasoning() + ev.close_message("completed" if status == "completed" else "incomplete") + \
                ev.close_calls():
            yield e
        done = build.response(status, final, ev.items, error="the request was aborted" if status == "failed" else None)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        yield ev.event(kind, response=done)
        complete = True

    def cleanup() -> None:
        if not complete:
            serving.metrics.on_disconnect("stream")
        serving.abort_unfinished(streams)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(cleanup))
