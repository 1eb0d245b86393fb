"""One streamed request against an OpenAI-compatible server, timed chunk by chunk.

`send_request` POSTs to ``{base_url}/v1/completions`` (or ``/v1/chat/completions``) with
``stream: true`` and ``stream_options: {include_usage: true}``, reads the server-sent events
until ``data: [DONE]`` (decoded by httpx-sse) and returns a `RequestResult`. It never raises for request-level
problems (HTTP errors, malformed events, time-outs, dropped connections): those become
``success=False`` with an ``error`` message, so a sweep always finishes.

Timing follows `vllm bench serve`: TTFT is the time from sending to the first chunk that
carries a token, ITL the gaps between later token chunks, E2EL the time to the end of the
stream. With speculative decoding one chunk may carry several tokens, so ITL is measured
between chunks while TPOT divides by tokens.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
from httpx_sse import SSEError, aconnect_sse

from adaspec.bench.datasets import SampleRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class ApiTarget:
    """Where and how to send requests. `base_url` is the server root (no ``/v1``)."""

    base_url: str
    model: str
    endpoint: str = "completions"        # "completions" | "chat"
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0             # whole-request limit, streaming included
    extra_body: tuple = ()               # (key, value) pairs added to every request body

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]


def server_root(url: str) -> str:
    """`url` without trailing slashes or a trailing /v1 (the OpenAI SDK's base_url habit):
    the routes are appended to the server's root (/v1/completions, /metrics)."""
    url = url.rstrip("/")
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


@dataclass
class RequestResult:
    """Outcome of one request. Times are seconds; `start_time` is `time.perf_counter()` at
    send. `output_tokens` comes from the final usage chunk when the server sends one
    (`usage_reported`), otherwise it is the number of token chunks. `prompt_len` is the
    server's `usage.prompt_tokens` when reported, else the sample's own count."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    usage_reported: bool = False
    num_chunks: int = 0


def chunk_text(chunk: dict, endpoint: str) -> tuple[bool, str]:
    """(is_token_chunk, text) of one parsed stream chunk.

    A token chunk has a choice that carries output: non-empty text, or empty text without
    a finish_reason (a token that decoded to nothing yet). Chat role announcements
    (``delta: {role: assistant, content: ""}``) and bare finish/usage chunks are not tokens.
    """
    choices = chunk.get("choices") or []
    if not choices:
        return False, ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        if not text and ("role" in delta or choice.get("finish_reason") is not None):
            return False, ""
        return (bool(text) or "content" in delta), text
    text = choice.get("text") or ""
    if not text and choice.get("finish_reason") is not None:
        return False, ""
    return True, text


def build_payload(target: ApiTarget, sample: SampleRequest) -> dict:
    """The JSON body for `sample`: completions take the prompt (text or token ids) as is,
    chat wraps a text prompt into one user message. `ignore_eos` is sent only when on."""
    body: dict = {"model": target.model, "max_tokens": sample.output_len,
                  "temperature": target.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if target.endpoint == "chat":
        if not isinstance(sample.prompt, str):
            raise ValueError("the chat endpoint needs text prompts; the random dataset sends "
                             "token ids - use --endpoint completions")
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if target.ignore_eos:
        body["ignore_eos"] = True
    body.update(dict(target.extra_body))
    return body


async def _stream(client: httpx.AsyncClient, target: ApiTarget, body: dict,
                  res: RequestResult) -> None:
    st = res.start_time
    last = st
    text_parts: list[str] = []
    token_chunks = 0
    async with aconnect_sse(client, "POST", target.url, json=body) as source:
        resp = source.response
        if resp.status_code != 200:
            detail = (await resp.aread()).decode("utf-8", "replace")[:500]
            res.error = f"HTTP {resp.status_code}: {detail}"
            return
        done = False
        async for event in source.aiter_sse():
            data = event.data
            now = time.perf_counter()
            if data.strip() == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                res.error = f"malformed stream event: {data[:200]!r}"
                return
            if not isinstance(chunk, dict):
                res.error = f"unexpected stream event: {data[:200]!r}"
                return
            if chunk.get("error"):
                err = chunk["error"]
                res.error = "server error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                return
            res.num_chunks += 1
            is_token, text = chunk_text(chunk, target.endpoint)
            if is_token:
                if token_chunks == 0:
                    res.ttft = now - st
                else:
                    res.itl.append(now - last)
                last = now
                token_chunks += 1
                text_parts.append(text)
            usage = chunk.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                res.output_tokens = int(usage["completion_tokens"])
                if usage.get("prompt_tokens") is not None:
                    res.prompt_len = int(usage["prompt_tokens"])
                res.usage_reported = True
        if not done:
            res.error = "stream ended without 'data: [DONE]'"
            return
    res.latency = time.perf_counter() - st
    res.generated_text = "".join(text_parts)
    if not res.usage_reported:
        res.output_tokens = token_chunks
    if token_chunks == 0:
        res.error = "no tokens received"
        return
    res.success = True


async def send_request(client: httpx.AsyncClient, target: ApiTarget,
                       sample: SampleRequest) -> RequestResult:
    """Send `sample`, stream the answer and time it. Never raises except on cancellation."""
    res = RequestResult(prompt_len=sample.prompt_len)
    body = build_payload(target, sample)
    res.start_time = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, target, body, res), timeout=target.timeout_s)
    except asyncio.TimeoutError:
        res.success, res.error = False, f"timed out after {target.timeout_s:g}s"
    except SSEError as e:   # a 200 that is not an event stream (an httpx error: caught first)
        res.success, res.error = False, f"not a server-sent event stream: {e}"
    except httpx.HTTPError as e:
        res.success, res.error = False, f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - a broken request must not stop the sweep
        res.success, res.error = False, f"{type(e).__name__}: {e}"
    if not res.success and res.latency == 0.0:
        res.latency = time.perf_counter() - res.start_time
    return res


def make_client(max_connections: int | None = None) -> httpx.AsyncClient:
    """An async client for benchmarking: no connection cap below `max_connections`, no
    environment proxies (localhost servers must not be routed through a proxy), per-read
    timeouts left to `send_request`'s whole-request limit."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits, trust_env=False)


class BenchError(RuntimeError):
    """A problem that stops a benchmark run (as opposed to one failed request)."""


class ServerUnreachable(BenchError):
    """The server did not answer at all (connection refused, DNS failure, time-out)."""


async def get_json(client: httpx.AsyncClient, url: str, timeout: float = 10.0) -> dict | None:
    """GET `url` as JSON; None on a non-200 answer or a body that is not a JSON object.
    Raises `ServerUnreachable` when no connection can be made."""
    try:
        r = await client.get(url, timeout=timeout)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout) as e:
        raise ServerUnreachable(f"cannot reach {url}: {type(e).__name__}: {e}") from e
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        obj = r.json()
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


async def get_text(client: httpx.AsyncClient, url: str, timeout: float = 10.0) -> str | None:
    """GET `url` as text; None on any failure or a non-200 answer."""
    try:
        r = await client.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


async def first_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id listed by ``GET {base_url}/v1/models``."""
    obj = await get_json(client, base_url.rstrip("/") + "/v1/models")
    data = (obj or {}).get("data") or []
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])
