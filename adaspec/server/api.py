"""The OpenAI-compatible HTTP API (FastAPI): the routes and the app factory.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (OpenAI's
Responses API over the chat path: `server/responses.py`), GET /v1/models, GET /health (and
GET/POST /ping, as vLLM),
(GET /version, GET /v1/models/{id}, POST /tokenize, POST /detokenize, the X-Request-Id header
and CORS: `server/routes_extra.py`),
GET /metrics (Prometheus text), GET /server_info (JSON: configuration and engine stats; with an
API key set, the model and draft directories appear as full paths only to a client sending it).
No trailing-slash redirects (their Location would reflect the client's Host): "/health/" is a 404.

Error contract: every error is {"error": {"message", "type", "param", "code"}}.
  400 invalid_request_error  malformed JSON, JSON nested deeper than MAX_JSON_DEPTH, a lone
                             surrogate in any string, an array longer than the context (or the
                             queue limit), wrong types (pydantic errors; FastAPI's 422 is
                             remapped too), out-of-range sampling values, empty prompt, prompt or
                             prompt + max_tokens over the context (text prompts too long to fit
                             are refused before tokenizing), n != 1, unsupported fields
  401 / 408 / 413 / 415      missing API key, body too slow, body too large, not JSON: see
                             `server/guard.py`
  404 invalid_request_error  unknown model (code "model_not_found", as OpenAI answers), unknown route
  503 overloaded_error       more than --max-queue-len requests in flight, or shutting down;
                             carries Retry-After. /health answers 503 while the engine is stalled
                             (requests pending and no progress, or no word from the engine, for
                             `stall_timeout_s`: see AsyncEngine.stalled_for) or stopped.
  500 server_error           an internal failure of that request only; the server keeps serving
A client that disconnects before its non-streaming answer is ready is not an error: its
requests are aborted and counted in adaspec_client_disconnects.
A failure after a stream has started is sent as a final `data: {"error": ...}` event before
`data: [DONE]`.

Sampling defaults, prompt encoding and streaming: `server/serving.py`; body parsing: `server/body.py`.
"""
from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaspec.server.async_engine import AsyncEngine
from adaspec.server.body import _error_path
from adaspec.server.guard import RequestGuard
from adaspec.server.metrics import ServerMetrics
from adaspec.server.protocol import APIError
from adaspec.server.responses import responses
from adaspec.server import routes_extra
from adaspec.server.serving import OpenAIServing, ServerSettings
from adaspec.server.stats_log import log_stats_forever

__all__ = ["OpenAIServing", "ServerSettings", "create_app"]

logger = logging.getLogger("adaspec.server")


def create_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """Build the app around a synchronous engine. The engine thread starts with the app's lifespan
    and stops (aborting what is left) when the app shuts down."""
    aengine = AsyncEngine(engine, stall_timeout_s=settings.stall_timeout_s)
    metrics = ServerMetrics(lambda: aengine.stats, lambda: aengine.num_inflight, settings.served_model_name)
    aengine.metrics = metrics
    serving = OpenAIServing(aengine, metrics, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        stats_task = (asyncio.create_task(log_stats_forever(lambda: aengine.stats, settings.log_stats_interval_s))
                      if settings.log_stats_interval_s > 0 else None)
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await aengine.stop(timeout=max(5.0, settings.shutdown_timeout))
            serving.worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="adaspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # No trailing-slash redirects: Starlette builds their Location from the Host header, which
    # makes the server reflect whatever Host a client sends. "/health/" is a 404.
    app.router.redirect_slashes = False
    app.state.aengine = aengine
    app.state.metrics = metrics
    app.state.serving = serving

    def error_response(e: APIError, reason: str) -> JSONResponse:
        metrics.on_rejected(reason)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if e.status >= 500 and e.status != 503 and not aengine.dead:   # (a dead engine is logged once)
            logger.error("%s %s failed: %s", request.method, request.url.path, e.message)
        return error_response(e, e.code or e.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # Bodies are parsed by `parse_body`; this covers anything FastAPI validates itself.
        errors = exc.errors()
        path = _error_path(errors[0]["loc"]) if errors else ""
        message = f"{path}: {errors[0]['msg']}" if errors else "invalid request"
        return error_response(APIError(message, param=path or None), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(str(exc.detail), status=exc.status_code, headers=exc.headers),
                              f"http_{exc.status_code}")

    # Uncaught exceptions are answered (500) by the RequestGuard, which keeps the connection.
    app.add_middleware(RequestGuard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.client_timeout_s, on_reject=metrics.on_rejected,
                       allowed_hosts=settings.allowed_hosts)

    # Bodies are read and validated by hand (not as FastAPI body parameters) so that every
    # validation failure becomes an OpenAI-style 400 (the guard has checked the content type).
    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await serving.completions(await raw.body(), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await serving.chat(await raw.body(), raw)

    @app.post("/v1/responses")
    async def responses_route(raw: Request):
        return await responses(serving, await raw.body(), raw)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "adaspec",
            "root": engine.config.model, "max_model_len": aengine.max_model_len}]}

    @app.get("/health")
    async def health():
        if not aengine.is_alive:
            body = {"status": "unavailable"}
            if aengine.dead:
                body["message"] = aengine.dead
            return JSONResponse(body, status_code=503)
        stalled = aengine.stalled_for
        if stalled is not None:
            return JSONResponse({"status": "stalled", "message": f"the engine has made no progress for "
                                 f"{stalled:.0f} s with requests pending"}, status_code=503)
        return {"status": "ok"}

    # SageMaker's (and vLLM's) liveness route: the same answer as /health.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info(raw: Request):
        info = serving.server_info()
        if not raw.scope.get("adaspec.authorized", True):
            # Open without the key (like /health), but without the server's filesystem layout.
            cfg = info["config"]
            for key in ("model_path", "draft"):
                if cfg.get(key):
                    cfg[key] = os.path.basename(os.path.normpath(cfg[key]))
        return info

    routes_extra.install(app, serving, settings)   # /version, /tokenize, ..., X-Request-Id, CORS
    return app
