"""The server against hostile and careless clients: a real `adaspec serve` process (tiny Llama with
a tokenizer, no draft) with an API key from the environment, a 64 KiB body limit and a 1.5 s
client timeout. Raw sockets (with h11 framing) where the point is what happens on one connection.

Nothing here may make the server log a traceback (checked when the module's server stops).
"""
from __future__ import annotations

import json
import socket

import h11
import httpx
import pytest

from adaspec.server.streaming import sse as _sse
from adaspec.testing import make_tiny_model
from server_helpers import ServerProcess, metrics, wait_for

KEY = "sk-adaspec-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json", **AUTH}
LIMIT = 64 * 1024
CLIENT_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def hserver(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("hardening") / "m", "llama", tokenizer=True)
    srv = ServerProcess(["--model", str(model), "--max-model-len", "512", "--num-kv-blocks", "256",
                         "--max-request-bytes", str(LIMIT), "--client-timeout", str(CLIENT_TIMEOUT)],
                        env={"ADASPEC_API_KEY": KEY})
    yield srv
    code, out = srv.stop()
    assert code == 0, out
    assert "Traceback" not in out, out


def exchange(port: int, requests: list[tuple[str, str, dict, bytes]]) -> list[tuple[int, dict, bytes]]:
    """Send requests one after another on ONE keep-alive connection; (status, headers, body) of
    each. Fails if the server closes the connection or asks to close it before the last one."""
    conn = h11.Connection(h11.CLIENT)
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for method, path, headers, body in requests:
            hdrs = [("Host", "test"), ("Content-Length", str(len(body))), *headers.items()]
            s.sendall(conn.send(h11.Request(method=method, target=path, headers=hdrs))
                      + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            status, resp_headers, data = None, {}, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    chunk = s.recv(65536)
                    assert chunk, f"the server closed the connection after {len(out)} answers"
                    conn.receive_data(chunk)
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    resp_headers = {k.decode().lower(): v.decode() for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    data += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            out.append((status, resp_headers, data))
            if len(out) < len(requests):
                conn.start_next_cycle()   # raises if the server said Connection: close
    return out


def read_until_closed(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


MODELS = ("GET", "/v1/models", AUTH, b"")


def post(body: bytes | dict, headers: dict = JSON, path: str = "/v1/completions"):
    return ("POST", path, headers, body if isinstance(body, bytes) else json.dumps(body).encode())


# (request, status, param or None). Each is followed on the same connection by GET /v1/models.
BAD = [
    (post(b'{"model": "tiny-llama", "prompt": "a \\ud800 b", "max_tokens": 2}'), 400, "prompt"),
    (post(b'{"model": "\\udfff", "prompt": "hi"}'), 400, "model"),
    (post(b'{"prompt": "hi", "\\ud800": 1}'), 400, None),
    (post(b'{"messages": [{"role": "user", "content": "\\udc00"}]}', path="/v1/chat/completions"), 400,
     "messages.0.content"),
    (post(b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"), 400, None),
    (post(b'{"x": ' + b"[" * 40 + b"]" * 40 + b', "prompt": "hi"}'), 400, None),
    (post({"prompt": "hi", "stop": ["s"] * 33}), 400, "stop"),
    (post({"prompt": "hi", "stop": "s" * 2000}), 400, "stop"),
    (post({"prompt": "hi", "stop_token_ids": list(range(257))}), 400, "stop_token_ids"),
    (post({"prompt": [5] * 5000}), 400, "prompt"),
    (post({"prompt": "word " * 10_000}), 400, "prompt"),       # refused before tokenizing
    (post({"prompt": "hi", "temperature": "hot"}), 400, "temperature"),
    (post(b"{not json"), 400, None),
    (post({"model": "nope", "prompt": "hi"}), 404, "model"),
    (post({"prompt": "hi"}, headers={"Content-Type": "text/plain", **AUTH}), 415, None),
    (post({"prompt": "hi"}, headers=AUTH), 415, None),
    (post({"prompt": "hi"}, headers={"Content-Type": "application/json"}), 401, None),
    (post({"prompt": "hi"}, headers={"Content-Type": "application/json", "Authorization": "Bearer nope"}), 401, None),
    (("GET", "/v1/models", {}, b""), 401, None),
]


def test_bad_requests_are_4xx_and_the_connection_stays_usable(hserver):
    requests = []
    for req, _, _ in BAD:
        requests += [req, MODELS]
    answers = exchange(hserver.port, requests + [post({"prompt": "hi", "max_tokens": 3, "ignore_eos": True})])
    for i, (req, status, param) in enumerate(BAD):
        got, headers, body = answers[2 * i]
        assert got == status, (req[3][:80], body)
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param, (req[3][:80], err)
        if status == 401:
            assert err["type"] == "authentication_error" and headers["www-authenticate"] == "Bearer"
        if b"word word" in req[3]:
            assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
        assert answers[2 * i + 1][0] == 200
    status, _, body = answers[-1]
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
    m = metrics(hserver.url)
    assert m.get('adaspec_request_rejected_total{reason="internal_error"}', 0) == 0
    assert m['adaspec_request_rejected_total{reason="unauthorized"}'] >= 3


def test_health_and_metrics_need_no_key(hserver):
    assert httpx.get(hserver.url + "/health").json() == {"status": "ok"}
    assert httpx.get(hserver.url + "/metrics").status_code == 200
    assert httpx.get(hserver.url + "/v1/models", headers=AUTH).status_code == 200


def test_oversized_bodies_are_413(hserver):
    # Declared too large: answered 413 without storing the body; the body is read and thrown
    # away, so the client sees the answer and the connection carries the next request.
    big = post(b'{"prompt": "' + b"x" * LIMIT + b'"}')
    answers = exchange(hserver.port, [big, MODELS])
    assert answers[0][0] == 413 and json.loads(answers[0][2])["error"]["type"] == "invalid_request_error"
    assert answers[1][0] == 200
    # Chunked, no length: refused as soon as it passes the limit, likewise.
    with socket.create_connection(("127.0.0.1", hserver.port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        piece = b"x" * 8192
        for _ in range(LIMIT // len(piece) + 1):
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        s.sendall(b"0\r\n\r\n")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        reply = read_until_closed(s)
    assert reply.startswith(b"HTTP/1.1 413") and b"HTTP/1.1 200" in reply
    # Far beyond the limit: the server reads (and drops) at most another LIMIT bytes, then
    # answers and closes. (The client sends no more than that: a close with unread data is a
    # reset, which could race the answer.)
    with socket.create_connection(("127.0.0.1", hserver.port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {KEY}\r\nContent-Length: {100 * LIMIT}\r\n\r\n".encode())
        s.sendall(b"x" * LIMIT)
        reply = read_until_closed(s)
    assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()
    assert metrics(hserver.url)['adaspec_request_rejected_total{reason="body_too_large"}'] >= 3


def test_slow_and_idle_connections_are_cut(hserver):
    idle = socket.create_connection(("127.0.0.1", hserver.port), timeout=30)
    half_head = socket.create_connection(("127.0.0.1", hserver.port), timeout=30)
    half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Ty")
    half_body = socket.create_connection(("127.0.0.1", hserver.port), timeout=30)
    half_body.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n{{\"prompt\": ".encode())
    try:
        assert read_until_closed(idle) == b""
        assert read_until_closed(half_head) == b""
        reply = read_until_closed(half_body)
        assert reply.startswith(b"HTTP/1.1 408") and b"was not received within" in reply
    finally:
        for s in (idle, half_head, half_body):
            s.close()
    assert httpx.get(hserver.url + "/health").status_code == 200


def test_client_disconnects_are_counted_not_errors(hserver):
    before = metrics(hserver.url)
    body = {"prompt": "Hello world", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(hserver.url + "/v1/completions", json=body, headers=AUTH, timeout=0.3)
    with httpx.stream("POST", hserver.url + "/v1/completions", json={**body, "stream": True},
                      headers=AUTH, timeout=30) as r:
        next(r.iter_lines())

    def counted():
        m = metrics(hserver.url)
        return all(m.get(f'adaspec_client_disconnects_total{{kind="{k}"}}', 0)
                   > before.get(f'adaspec_client_disconnects_total{{kind="{k}"}}', 0)
                   for k in ("non_stream", "stream"))
    wait_for(counted, what="both disconnects counted")
    wait_for(lambda: httpx.get(hserver.url + "/server_info").json()["stats"]["num_inflight"] == 0,
             what="the abandoned requests aborted")
    m = metrics(hserver.url)
    assert m.get('adaspec_request_rejected_total{reason="internal_error"}', 0) == 0
    assert "Traceback" not in hserver.output()


def test_sse_escapes_unicode_line_breaks():
    text = "a\u2028b\u2029c\x85d\ne"
    line = _sse({"text": text})
    assert line.endswith("\n\n") and line.count("\n") == 2
    assert not any(ch in line for ch in "\u2028\u2029\x85")
    assert len(line.rstrip("\n").splitlines()) == 1   # what a line-splitting client sees
    assert json.loads(line[len("data: "):]) == {"text": text}
    assert "é" in _sse({"t": "é"})   # other characters stay raw (ensure_ascii=False)


def test_cli_rejects_nonpositive_limits(tmp_path):
    from adaspec.server.cli import serve_main
    assert serve_main(["--model", str(tmp_path), "--max-request-bytes", "0"]) == 2
    assert serve_main(["--model", str(tmp_path), "--client-timeout", "-1"]) == 2
