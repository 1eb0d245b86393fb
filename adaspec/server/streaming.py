"""Server-sent events: one event per engine output, as OpenAI streams them."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from adaspec.engine.request import RequestOutput
from adaspec.server.request_stream import EngineError, RequestStream
from adaspec.server.protocol import APIError

# Characters that JSON leaves raw but line-splitting SSE clients (str.splitlines, JS readers)
# take for line breaks; escaped so an event never breaks inside its JSON.
_SSE_ESCAPES = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':')).translate(_SSE_ESCAPES)}\n\n"


def stream_response(serving, streams: list[RequestStream], chunk, base: dict, req, first) -> StreamingResponse:
    """The SSE response of `streams` (one per choice): `first(i)` (chat: the role chunk), then
    `chunk(i, out)` per output (a chunk or a list of them), the usage chunk if asked, an error event on an engine failure,
    `[DONE]`; unfinished streams are aborted when the client goes away."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    # vLLM's continuous_usage_stats (with include_usage): each chunk carries its choice's usage so far.
    continuous = include_usage and req.stream_options.continuous_usage_stats
    complete = False      # the body was sent to the end

    async def body() -> AsyncIterator[str]:
        nonlocal complete
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            if first is not None:
                for i in range(len(streams)):
                    yield sse(with_usage(first(i), include_usage))
            async for i, out in serving.merge(streams):
                if out.finished:
                    finals[i] = out
                # Skip empty mid-stream outputs (e.g. text held back by the detokenizer) unless
                # the client asked for token ids or logprobs, which are never held back.
                if out.finished or out.new_text or ((req.return_token_ids or out.new_logprobs) and out.new_token_ids) \
                        or (out.new_text is None and out.new_token_ids):
                    objs = chunk(i, out)   # one chunk, or several (tool-call deltas)
                    for obj in objs if isinstance(objs, list) else [objs]:
                        obj = with_usage(obj, include_usage)
                        if continuous:
                            obj["usage"] = serving.usage([out])
                        yield sse(obj)
            if include_usage:
                yield sse({**base, "choices": [], "usage": serving.usage(finals, req.n)})  # type: ignore[arg-type]
        except EngineError as e:
            serving.metrics.on_rejected("engine_error")
            yield sse(APIError(str(e), status=500, type="server_error", code="engine_error").body())
        complete = True
        yield "data: [DONE]\n\n"

    # The background task runs even when the client disconnects before the first chunk, a case
    # in which the generator's own cleanup never runs (it was never started).
    def cleanup() -> None:
        if not complete:   # the client went away first (a normal event, not an error)
            serving.metrics.on_disconnect("stream")
        serving.abort_unfinished(streams)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(cleanup))


def with_usage(obj: dict, include_usage: bool) -> dict:
    if include_usage:
        obj["usage"] = None
    return obj
