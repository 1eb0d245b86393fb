"""The routes and headers beyond the completion endpoints that OpenAI clients and vLLM users
expect (`install(app, serving, settings)` adds them all):

  GET  /version             {"version": adaspec's version}
  GET  /v1/models/{id}      one model card (the SDK's `models.retrieve`); an unknown id is a 404
                            with code "model_not_found", as OpenAI answers
  POST /tokenize            {"prompt": str} or {"messages": [...]} (vLLM's body, optional
                            "add_special_tokens" for a prompt, default true) ->
                            {"count", "max_model_len", "tokens"}; the tokens a completion or chat
                            request with that body would be given
  POST /detokenize          {"tokens": [int]} -> {"prompt": text}
  X-Request-Id              every response carries the request's X-Request-Id header, or one
                            made up when the request had none (for tracing across proxies)
  CORS                      with `allowed_origins` (--allowed-origins), browsers at those
                            origins may call the API: preflights (OPTIONS) are answered
                            before authentication, as the Fetch standard requires
Tokenizing runs on the serving worker thread, like every other prompt (the tokenizer is not
thread-safe). /tokenize, /detokenize and /version are outside /v1/, so, as in vLLM, they stay
open when an API key is set (they reveal the tokenizer, nothing else); /v1/models/{id} needs it.
"""
from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from pydantic import Field
from starlette.middleware.cors import CORSMiddleware

from adaspec import __version__
from adaspec.server.body import parse_body
from adaspec.server.chat_prompt import encode_chat_untrusted
from adaspec.server.protocol import APIError, ChatMessage, Int64, StrictBool, StrictStr, _Strict
from adaspec.tokenization import has_chat_template


class TokenizeRequest(_Strict):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[Int64] = Field(min_length=0)


class RequestIdMiddleware:
    """Echo X-Request-Id (or a fresh one) on every HTTP response (pure ASGI: streams untouched)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        # A header value is echoed only if it is a plain token (no control characters), so a
        # client cannot make the server write arbitrary header bytes.
        if given is None or len(given) > 256 or not all(0x21 <= c <= 0x7E for c in given):
            given = uuid.uuid4().hex.encode()

        async def with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, with_id)


def install(app: FastAPI, serving, settings) -> None:
    """Add the routes and middleware above to `app` (call after the guard is added, so that
    CORS and X-Request-Id wrap it and also answer its rejections)."""
    aengine = serving.aengine

    def model_card() -> dict:
        return {"id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "adaspec",
                "root": aengine.config.model, "max_model_len": aengine.max_model_len}

    def check_model(name: str | None) -> None:
        if name is not None and name not in serving.model_names:
            raise APIError(f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found")

    def tokenizer():
        if serving.tokenizer is None:
            raise APIError("this model has no tokenizer", param="prompt")
        return serving.tokenizer

    def tokenize(body: bytes) -> dict:
        req = parse_body(body, TokenizeRequest, serving.max_array_len)
        check_model(req.model)
        tok = tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give either prompt or messages", param="prompt")
        if req.prompt is not None:
            serving._check_prompt_chars(len(req.prompt), "prompt")
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            if not has_chat_template(tok):
                raise APIError("this model has no chat template", param="messages")
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            serving._check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
            try:
                ids = encode_chat_untrusted(tok, messages)
            except Exception as e:  # the template's own errors
                raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
        return {"count": len(ids), "max_model_len": aengine.max_model_len, "tokens": ids}

    def detokenize(body: bytes) -> dict:
        req = parse_body(body, DetokenizeRequest, serving.max_array_len)
        check_model(req.model)
        tok = tokenizer()
        vocab = len(tok)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tok.decode(req.tokens)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize_route(raw: Request):
        return await serving.off_loop(tokenize, await raw.body())

    @app.post("/detokenize")
    async def detokenize_route(raw: Request):
        return await serving.off_loop(detokenize, await raw.body())

    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)
