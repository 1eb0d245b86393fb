"""What stands between the network and the API: access control, body limits, time limits, and
a last-resort error answer that keeps the connection usable.

`RequestGuard` (ASGI middleware, outermost but for Starlette's own error middleware), in order:
  400 invalid_request_error a Host header that `allowed_hosts` does not list (when it lists any:
                            against DNS rebinding), or several Host or Authorization headers
                            (which one would count is ambiguous; RFC 9110 makes several Hosts a 400)
  401 authentication_error  /v1/* without `Authorization: Bearer <api key>` (when a key is set);
                            /health, /metrics and /server_info stay open (vLLM does the same), but
                            /server_info shows filesystem paths only with the key: the guard
                            records in scope["adaspec.authorized"] whether the request had it
  413 invalid_request_error a body over `max_body_bytes`: known from Content-Length before a
                            byte of it is stored, or as soon as a chunked body passes the limit
  415 invalid_request_error a POST whose Content-Type is not application/json (a web page can
                            post text/plain across origins without a preflight; not JSON)
  408 invalid_request_error the body not complete `body_timeout_s` after the headers (slowloris)
  500 server_error          an exception no handler caught, answered here (not re-raised) so the
                            keep-alive connection survives it; logged with its traceback
Before a 401, 413 or 415 the (rest of the) body is read and thrown away, up to `max_body_bytes`
within the deadline: a client still sending would otherwise be reset, and a reset can destroy
the answer in its receive buffer. If the whole body was read the connection stays open, else it
is closed, as it is after a 408. Every other error response leaves the connection open.

`GuardedH11Protocol` (uvicorn's h11 protocol) closes connections that have not sent a complete
request head within `header_timeout_s` of opening or of their last response: ASGI middleware
never sees a connection before its headers are complete. Idle keep-alive connections are
closed by uvicorn's own `timeout_keep_alive`. It also answers 400 and closes the connection,
before h11 (which is lenient here) parses the head, for a request head with
  * both Content-Length and Transfer-Encoding: a proxy in front that frames the body by
    Content-Length would see a different request boundary than we do (request smuggling,
    RFC 9112 6.1 lets a server reject it and requires closing the connection after);
  * a bare LF line ending, or an obsolete folded header line (RFC 9112 2.2, 5.2): other
    parsers on the path may split such a head differently.
The check reads h11's public `trailing_data` (received, unparsed bytes) whenever a new request
head is due, which also covers heads pipelined behind an earlier request.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Callable

import h11
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("adaspec.server")


class _Reject(Exception):
    """Raised from inside `receive` to abandon a request whose body breaks a limit."""

    def __init__(self, status: int, message: str, reason: str):
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


def error_body(message: str, type: str = "invalid_request_error", code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a Host header value (port ignored) matches `allowed`: exact names (any case),
    "*.example.com" for its subdomains, "*" for any; an empty `allowed` allows any."""
    if not allowed or "*" in allowed:
        return True
    host = host.strip().lower()
    name = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    if not name:
        return False
    for pattern in allowed:
        p = pattern.lower()
        if p.startswith("[") and p.endswith("]"):
            p = p[1:-1]
        if name == p or (p.startswith("*.") and name.endswith(p[1:])):
            return True
    return False


class RequestGuard:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, body_timeout_s: float,
                 on_reject: Callable[[str], None], allowed_hosts: tuple[str, ...] = ()):
        self.app = app
        self.allowed_hosts = tuple(allowed_hosts)
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        deadline = time.monotonic() + self.body_timeout_s
        scope["adaspec.authorized"] = self._has_key(headers)
        early = self._duplicate_or_host(scope, headers) or self._check_head(scope, headers)
        if early is not None:
            # A client that asked to be told before sending its body gets told, not drained.
            read_all = headers.get("expect", "").lower() != "100-continue" and await self._drain(receive, deadline)
            return await self._answer(send, *early, close=not read_all)
        received = 0
        body_done = scope["method"] in ("GET", "HEAD")
        started = False

        async def guarded_receive():
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise _Reject(408, f"the request body was not received within {self.body_timeout_s:g} s",
                              "body_timeout") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_body_bytes:
                    raise _Reject(413, self._too_large(), "body_too_large")
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracked_send)
        except _Reject as r:
            if started:
                raise
            read_all = r.status == 413 and (body_done or await self._drain(receive, deadline))
            await self._answer(send, r.status, r.message, r.reason, close=not read_all)
        except ClientDisconnect:
            return   # the connection closed while its body was read (e.g. at shutdown): no one to answer
        except Exception:
            logger.exception("%s %s failed", scope["method"], scope["path"])
            if started:  # a response is half sent: the connection cannot be saved
                raise
            await self._answer(send, 500, "internal server error", "internal_error", type="server_error")

    def _has_key(self, headers: dict[str, str]) -> bool:
        """True when no key is set, or the request carries it (constant-time compare)."""
        if self.api_key is None:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)

    def _duplicate_or_host(self, scope, headers: dict[str, str]) -> tuple | None:
        names = [k.lower() for k, _ in scope["headers"]]
        for name, shown in ((b"host", "Host"), (b"authorization", "Authorization")):
            if names.count(name) > 1:
                return 400, f"the request has several {shown} headers", f"duplicate_{shown.lower()}"
        if not host_allowed(headers.get("host", ""), self.allowed_hosts):
            # The value is not echoed: nothing a client sends as Host ends up in an answer.
            return 400, "this server does not answer for that Host (see --allowed-hosts)", "invalid_host"
        return None

    def _check_head(self, scope, headers: dict[str, str]) -> tuple | None:
        """(status, message, reason, ...) to answer before reading anything, or None."""
        if self.api_key is not None and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            if not scope["adaspec.authorized"]:
                return (401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                        "unauthorized", "authentication_error", "invalid_api_key")
        if scope["method"] == "POST":
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                return 413, self._too_large(), "body_too_large"
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return (415, f"the request body must be JSON sent as Content-Type: application/json "
                             f"(got {media or 'no content type'!r})", "unsupported_media_type")
        return None

    async def _drain(self, receive, deadline: float) -> bool:
        """Read and discard the rest of a refused body; True if it was read to its end."""
        budget = self.max_body_bytes
        while budget > 0:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return False
            if message["type"] != "http.request":
                return False
            budget -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    def _too_large(self) -> str:
        return f"the request body exceeds the server's limit of {self.max_body_bytes} bytes"

    async def _answer(self, send, status: int, message: str, reason: str,
                      type: str = "invalid_request_error", code: str | None = None, close: bool = False):
        self.on_reject(reason)
        body = error_body(message, type, code)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def head_problem(data: bytes) -> str | None:
    """What is wrong with the request head at the start of `data` (complete or not), or None.
    Only what h11 accepts but a strict parser would not: see the module docstring."""
    data = data.lstrip(b"\r\n")   # empty lines before a request line may be ignored (RFC 9112 2.2)
    ends = [i for i in (data.find(b"\n\r\n"), data.find(b"\n\n")) if i >= 0]
    complete = bool(ends)
    head = data[:min(ends) + 1] if ends else data
    if head.replace(b"\r\n", b"").count(b"\n"):
        return "a line of the request head ends in a bare LF; lines must end in CRLF"
    lines = head.split(b"\r\n")
    if any(line[:1] in (b" ", b"\t") for line in lines[1:]):
        return "the request head has a folded header line (obsolete line folding)"
    if complete:
        names = {line.split(b":", 1)[0].strip().lower() for line in lines[1:] if b":" in line}
        if b"content-length" in names and b"transfer-encoding" in names:
            return "the request has both Content-Length and Transfer-Encoding"
    return None


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for each request head and a strict look at each
    head before h11 parses it (see the module docstring)."""

    header_timeout_s: float = 30.0   # set by `with_header_timeout`

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type["GuardedH11Protocol"]:
        return type("GuardedH11Protocol", (cls,), {"header_timeout_s": seconds})

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_generation = 0
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def handle_events(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            data, _ = self.conn.trailing_data
            problem = head_problem(data) if data else None
            if problem is not None:
                body = error_body(problem)
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
                self.transport.close()
                return
        super().handle_events()

    def _arm_head_deadline(self) -> None:
        self._head_generation += 1
        self.loop.call_later(self.header_timeout_s, self._head_deadline, self._head_generation)

    def _head_deadline(self, generation: int) -> None:
        # Stale timers (a later request re-armed it) and connections mid-request are left alone;
        # a connection still waiting for (the rest of) a request head is closed.
        if generation != self._head_generation or self.transport.is_closing():
            return
        if self.conn.their_state in (h11.IDLE, h11.DONE) and self.conn.our_state in (h11.IDLE, h11.DONE):
            self.transport.close()
