"""`OpenAIServing`: OpenAI requests in, engine requests out; engine outputs in, OpenAI
responses and SSE streams out. The routes (`server/api.py`) only hand it bodies.

Defaults (documented because OpenAI leaves them to the server):
  max_tokens  /v1/completions: min(16, context left), the legacy OpenAI default;
              /v1/chat/completions: all the context left after the prompt.
  temperature, top_p, top_k, min_p, penalties: the model's generation_config.json where it sets them
              (--generation-config auto, the default; e.g. Llama-3.1: 0.6 / 0.9), else
              1.0, 1.0, -1 (off), 0.0 (OpenAI's and vLLM's). /server_info shows the ones in
              force under config.sampling_defaults; a request's own fields always win.
Sampling fields become SamplingParams in `server/request_params.py`; SSE events are built in
`server/streaming.py`. Prompts are encoded as `adaspec/tokenization.py` states (shared with
`adaspec generate`); chat content never becomes control tokens (`server/chat_prompt.py`).
Bodies are parsed, validated and tokenized on one worker thread (the tokenizer is not
thread-safe), never on the event loop, so a large prompt does not stall the other streams.
A failure after a stream has started is sent as a final `data: {"error": ...}` event before
`data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from adaspec.engine.request import RequestOutput
from adaspec.sampling import MAX_N
from adaspec.server.async_engine import AsyncEngine
from adaspec.server.request_stream import EngineError, RequestStream
from adaspec.server.body import parse_body
from adaspec.server.chat_tools import ToolOutput, chat_messages, default_parser_name, template_kwargs
from adaspec.server.structured_request import GrammarCheck, structured_of, tool_grammar, tool_mode
from adaspec.server.tool_parsers import get_tool_parser
from adaspec.server.metrics import ServerMetrics
from adaspec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from adaspec.server.reasoning import get_reasoning_parser, opens_reasoning
from adaspec.server.logprobs import TokenText, chat_logprobs, completion_logprobs, cut_alternatives, \
    prompt_logprobs_json
from adaspec.server.streaming import stream_response
from adaspec.server.chat_prompt import encode_chat_untrusted
from adaspec.server.info import server_info
from adaspec.server.request_params import Prepared, max_prompt_chars, param_of, prepare_choices, request_ids
from adaspec.tokenization import encode_text, has_chat_template

logger = logging.getLogger("adaspec.server")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass
class ServerSettings:
    served_model_name: str
    max_queue_len: int = 1024
    retry_after_s: int = 1
    shutdown_timeout: float = 30.0
    api_key: str | None = None               # required as a Bearer token on /v1/* when set
    max_body_bytes: int = 8 * 1024 * 1024    # larger request bodies get 413
    client_timeout_s: float = 30.0           # request head / body deadline (slow clients get cut)
    stall_timeout_s: float = 5.0             # /health fails after this long without engine progress
    # Prompts x n one request may hold: well below the queue, so one client's batch cannot take
    # every place in it (more is a 400, since waiting would not help).
    max_prompts_per_request: int = 64
    allowed_hosts: tuple[str, ...] = ()      # Host header values accepted (empty: any); see guard.py
    allowed_origins: tuple[str, ...] = ()    # CORS origins (empty: no CORS); see routes_extra.py
    log_stats_interval_s: float = 0.0        # the periodic stats line (server/stats_log.py); 0: off
    tool_call_parser: str | None = None      # server/tool_parsers.py name; None: the model family's
    # vLLM's flags (server/vllm_flags.py)
    prompt_tokens_details: bool = False      # usage.prompt_tokens_details.cached_tokens
    tokens_as_ids: bool = False              # default of a request's return_tokens_as_token_ids
    response_role: str = "assistant"         # role of chat answers
    reasoning_parser: str | None = None      # server/reasoning.py name: <think> text -> reasoning_content


async def _wait_for_disconnect(raw: Request) -> None:
    """Return when the client closes the connection (the body has already been read)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, aengine: AsyncEngine, metrics: ServerMetrics, settings: ServerSettings):
        self.aengine = aengine
        self.metrics = metrics
        self.settings = settings
        self.model_names = {settings.served_model_name, aengine.config.model}
        # A private copy: the engine thread detokenizes with its own tokenizer while the event
        # loop encodes prompts, and HF fast tokenizers are not safe to share across threads.
        tok = aengine.tokenizer
        try:
            self.tokenizer = copy.deepcopy(tok)
        except Exception:
            self.tokenizer = tok
        # Bodies are parsed and prompts tokenized here, one at a time (so the tokenizer copy is
        # only ever used by this thread) and off the event loop.
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="adaspec-prepare")
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, aengine.max_model_len)
        # Arrays longer than this cannot be valid: no field holds more items than the context has
        # tokens (token ids, messages) or the queue has places (prompts in a batch).
        self.max_array_len = max(aengine.max_model_len, settings.max_queue_len)
        self.tool_parser = get_tool_parser(settings.tool_call_parser or default_parser_name(aengine.config.model))
        self.reasoning = get_reasoning_parser(settings.reasoning_parser)
        self.check_grammar = GrammarCheck(self.tokenizer, aengine)
        try:   # the event loop's own copy, for tool-call text (decoded with special tokens)
            self.loop_tokenizer = copy.deepcopy(tok)
        except Exception:
            self.loop_tokenizer = tok

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    def _check_prompt_chars(self, n: int, param: str) -> None:
        if self.max_prompt_chars is not None and n > self.max_prompt_chars:
            raise APIError(f"the prompt has {n} characters, more than can fit the context of "
                           f"{self.aengine.max_model_len} tokens", param=param, code="context_length_exceeded")

    # ----- request preparation ---------------------------------------------------------------
    def _check_common(self, req) -> None:
        if req.model is not None and req.model not in self.model_names:
            raise APIError(f"The model `{req.model}` does not exist.", status=404, param="model",
                           code="model_not_found")
        if req.stream and req.prompt_logprobs is not None:   # (as vLLM)
            raise APIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        if not 1 <= req.n <= MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
        bad = req.unsupported()
        if bad is not None:
            raise APIError(bad[1], param=bad[0])

    def prepare_completion(self, req: CompletionRequest) -> list[Prepared]:
        self._check_common(req)
        p = req.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and isinstance(p[0], int):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError("the prompt is empty", param="prompt")
        limit = min(self.settings.max_prompts_per_request, self.settings.max_queue_len)
        if len(prompts) * req.n > limit:  # could never be admitted: a 400, not a 503
            raise APIError(f"{len(prompts)} prompts in one request exceed the server's limit of {limit} "
                           f"per request (--max-prompts-per-request); send them in several requests",
                           param="prompt")
        structured, field = structured_of(req)
        self.check_grammar(structured, field)
        out = []
        for item in prompts:
            if isinstance(item, str):
                if not item:
                    raise APIError("the prompt is empty", param="prompt")
                self._check_prompt_chars(len(item), "prompt")
                if self.tokenizer is None:
                    raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
                ids = encode_text(self.tokenizer, item, req.add_special_tokens is not False)
            else:
                ids = list(item)
            choices = prepare_choices(self.aengine, req, ids, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt", structured)
            if req.echo:   # (a truncated prompt is echoed as what the model saw)
                kept = choices[0].prompt_ids
                text = item if isinstance(item, str) and kept == ids else \
                    (self.tokenizer.decode(kept) if self.tokenizer else "")
                for c in choices:
                    c.prompt_text = text
            out += choices
        return out

    def prepare_chat(self, req: ChatCompletionRequest) -> list[Prepared]:
        self._check_common(req)
        if not has_chat_template(self.tokenizer):
            raise APIError("this model has no chat template; use /v1/completions", param="messages")
        if req.add_special_tokens:
            raise APIError("add_special_tokens=true is not supported for chat: the chat template writes the "
                           "special tokens", param="add_special_tokens")
        mode, name = tool_mode(req)
        structured, field = structured_of(req)
        forced = tool_grammar(req, mode, name)
        if structured is not None and forced is not None:
            raise APIError(f"{field} and tool_choice={req.tool_choice!r} both constrain the output; send one",
                           param=field)
        structured, field = (forced, "tools") if forced is not None else (structured, field)
        self.check_grammar(structured, field)
        messages = chat_messages(req)
        self._check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        kw = template_kwargs(req)
        try:
            ids = encode_chat_untrusted(self.tokenizer, messages, kw)
        except Exception as e:  # jinja's TemplateError or a template's raise_exception()
            raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
        prepared = prepare_choices(self.aengine, req, ids, self.aengine.max_model_len, "messages", structured)
        for p in prepared:
            p.tools = (mode, name)
        return prepared

    # ----- submission -----------------------------------------------------------------------------
    async def submit(self, request_id: str, prepared: list[Prepared]) -> list[RequestStream]:
        """Add every prompt of a request, all or nothing."""
        s = self.settings
        if self.aengine.stopping:
            raise APIError("the server is shutting down", status=503, type="overloaded_error",
                           code="shutting_down", headers={"Retry-After": str(s.retry_after_s)})
        if self.aengine.num_inflight + len(prepared) > s.max_queue_len:
            raise APIError(f"the server is overloaded ({self.aengine.num_inflight} requests in flight, "
                           f"limit {s.max_queue_len}); retry later", status=503, type="overloaded_error",
                           code="server_overloaded", headers={"Retry-After": str(s.retry_after_s)})
        arrival = time.monotonic()
        # submit() is synchronous, so the in-flight count above cannot be raced by other requests.
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prepared):
                streams.append(self.aengine.submit(f"{request_id}-{i}", p.prompt_ids, p.params, arrival))
            results = await asyncio.gather(*(self.aengine.accepted(st) for st in streams),
                                           return_exceptions=True)
        except EngineError as e:
            results = [e]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if not errors:
            return streams
        for st in streams:
            self.aengine.abort(st.request_id)
        err = errors[0]
        if isinstance(err, ValueError):
            raise APIError(str(err), param=param_of(err, "prompt"))
        if isinstance(err, EngineError):
            status = 503 if self.aengine.stopping or not self.aengine.is_alive else 500
            raise APIError(str(err), status=status, type="server_error", code="engine_error")
        raise err

    async def merge(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (choice index, output) from all streams as they come; abort the unfinished on exit."""
        try:
            if len(streams) == 1:
                async for out in streams[0]:
                    yield 0, out
                return
            q: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, st: RequestStream) -> None:
                try:
                    async for out in st:
                        q.put_nowait((i, out))
                except Exception as e:
                    q.put_nowait((i, e))
                finally:
                    q.put_nowait((i, None))

            tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
            try:
                remaining = len(streams)
                while remaining:
                    i, item = await q.get()
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield i, item
            finally:
                for t in tasks:
                    t.cancel()
        finally:
            self.abort_unfinished(streams)

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for st in streams:
            if not st.finished:
                self.aengine.abort(st.request_id)

    async def collect(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput] | None:
        """The final output of every stream, or None if the client disconnected first."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def run() -> None:
            async for i, out in self.merge(streams):
                if out.finished:
                    finals[i] = out

        work = asyncio.create_task(run())
        watcher = asyncio.create_task(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            # Decided before cancel(): a cancelled task is not done (nor readable) until it
            # has run its cancellation, so asking it afterwards would raise.
            disconnected = not work.done()
            if disconnected:
                work.cancel()
                self.abort_unfinished(streams)
        if disconnected:
            self.metrics.on_disconnect("non_stream")
            return None
        exc = work.exception()
        if isinstance(exc, EngineError):
            raise APIError(str(exc), status=500, type="server_error", code="engine_error")
        if exc is not None:
            raise exc
        return finals  # type: ignore[return-value]

    # ----- response bodies ------------------------------------------------------------------------
    def usage(self, finals: list[RequestOutput], n: int = 1) -> dict:
        """Token counts; a prompt's tokens count once however many choices it has."""
        p = sum(len(o.prompt_token_ids) for o in finals[::n])
        c = sum(len(o.token_ids) for o in finals)
        out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if self.settings.prompt_tokens_details:
            out["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in finals[::n])}
        return out

    def _as_ids(self, req) -> bool:
        given = req.return_tokens_as_token_ids
        return self.settings.tokens_as_ids if given is None else given

    def _parse_and_prepare(self, body: bytes, model: type[BaseModel], prepare):
        req = parse_body(body, model, self.max_array_len)
        return req, prepare(req)

    async def completions(self, body: bytes, raw: Request) -> Response:
        req, prepared = await self.off_loop(self._parse_and_prepare, body, CompletionRequest,
                                            self.prepare_completion)
        rid, internal = request_ids("cmpl", req, raw.headers)
        created = int(time.time())
        model = req.model or self.settings.served_model_name
        streams = await self.submit(internal, prepared)
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        text_of = TokenText(self.tokenizer, self._as_ids(req))
        offsets = [0] * len(prepared)     # text offset of each choice's next token
        started = [False] * len(prepared)

        def choice(i: int, text: str, out: RequestOutput, finish: str | None, new_ids: list[int], lps) -> dict:
            if prepared[i].echo_only:   # (echo with max_tokens 0: the generated token is not part of the answer)
                text, new_ids, lps = "", [], []
            prompt = first = None
            if not started[i]:   # the echoed prompt (and its logprobs) once, before the choice's first text
                started[i] = first = True
                if req.echo:
                    text = (prepared[i].prompt_text or "") + text
                    if out.prompt_logprobs is not None and req.logprobs is not None:
                        prompt = (out.prompt_token_ids, cut_alternatives(out.prompt_logprobs, req.logprobs))
            logprobs = None
            if req.logprobs is not None:
                logprobs, offsets[i] = completion_logprobs(text_of, new_ids, lps or [], offsets[i], prompt)
            c = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish,
                 "stop_reason": out.stop_reason if finish is not None else None}
            if first and req.prompt_logprobs is not None:
                c["prompt_logprobs"] = prompt_logprobs_json(text_of, out.prompt_token_ids, out.prompt_logprobs,
                                                            req.prompt_logprobs)
            if req.return_token_ids:
                c["token_ids"] = new_ids
                if finish is not None or not req.stream:
                    c["prompt_token_ids"] = out.prompt_token_ids
            return c

        if req.stream:
            def chunk(i: int, out: RequestOutput) -> dict:
                finish = out.finish_reason if out.finished else None
                return {**base, "choices": [choice(i, out.new_text or "", out, finish, out.new_token_ids,
                                                   out.new_logprobs)]}
            return stream_response(self, streams, chunk, base, req, first=None)

        finals = await self.collect(streams, raw)
        if finals is None:
            return Response(status_code=499)
        return JSONResponse({**base, "choices": [choice(i, o.text or "", o, o.finish_reason, o.token_ids, o.logprobs)
                                                 for i, o in enumerate(finals)],
                             "usage": self.usage(finals, req.n)})

    async def chat(self, body: bytes, raw: Request) -> Response:
        req, prepared = await self.off_loop(self._parse_and_prepare, body, ChatCompletionRequest,
                                            self.prepare_chat)
        rid, internal = request_ids("chatcmpl", req, raw.headers)
        created = int(time.time())
        model = req.model or self.settings.served_model_name
        streams = await self.submit(internal, prepared)
        text_of = TokenText(self.tokenizer, self._as_ids(req))
        # vLLM's echo: the answer starts with the last message's content when that is the assistant's.
        last = req.messages[-1]
        echo = last.text() if req.echo and last.role == self.settings.response_role else ""

        def logprobs(ids: list[int], lps) -> dict | None:
            return chat_logprobs(text_of, ids, lps or []) if req.logprobs else None

        tools = self.tool_outputs(req, prepared)
        if req.stream:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

            def first(i: int) -> dict:
                return {**base, "choices": [{"index": i, "delta": {"role": self.settings.response_role, "content": echo},
                                             "logprobs": None, "finish_reason": None}]}

            def chunk(i: int, out: RequestOutput) -> dict | list[dict]:
                finish = out.finish_reason if out.finished else None
                if tools[i].active:
                    return tools[i].chunks(base, i, out, finish, logprobs(out.new_token_ids, out.new_logprobs))
                delta = {"content": out.new_text} if out.new_text else {}
                c = {"index": i, "delta": delta, "logprobs": logprobs(out.new_token_ids, out.new_logprobs),
                     "finish_reason": finish, "stop_reason": out.stop_reason if finish is not None else None}
                if req.return_token_ids:
                    c["token_ids"] = out.new_token_ids
                return {**base, "choices": [c]}
            return stream_response(self, streams, chunk, base, req, first=first)

        finals = await self.collect(streams, raw)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for i, o in enumerate(finals):
            message, finish = {"role": self.settings.response_role, "content": echo + (o.text or "")}, o.finish_reason
            if tools[i].active:
                message, called = tools[i].message(o)
                message["role"] = self.settings.response_role
                finish = "tool_calls" if called and finish == "stop" else finish
            c = {"index": i, "message": message, "logprobs": logprobs(o.token_ids, o.logprobs),
                 "finish_reason": finish, "stop_reason": o.stop_reason}
            if req.return_token_ids:
                c["token_ids"] = o.token_ids
                c["prompt_token_ids"] = o.prompt_token_ids
            choices.append(c)
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": self.usage(finals, req.n)}
        if req.prompt_logprobs is not None:   # (vLLM: one list for the prompt all choices share)
            body["prompt_logprobs"] = prompt_logprobs_json(text_of, finals[0].prompt_token_ids,
                                                           finals[0].prompt_logprobs, req.prompt_logprobs)
        return JSONResponse(body)

    def tool_outputs(self, req: ChatCompletionRequest, prepared: list[Prepared]) -> list[ToolOutput]:
        """Per choice: how its answer is read (tool calls, reasoning; `server/chat_tools.py`)."""
        mode, name = prepared[0].tools
        eos = set(getattr(self.aengine, "eos_token_ids", None) or [])
        schemas = {t.function.name: (t.function.parameters or {}).get("properties") or {} for t in req.tools or []}
        opened = self.reasoning is not None and opens_reasoning(self.loop_tokenizer, prepared[0].prompt_ids)
        return [ToolOutput(mode, name, self.tool_parser, self.loop_tokenizer, eos, schemas, self.reasoning, opened)
                for _ in prepared]

    def server_info(self) -> dict:
        """/server_info (`server/info.py`)."""
        return server_info(self)
