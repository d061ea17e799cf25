"""The HTTP layer over real sockets (the fake engine served by uvicorn in a thread, with the
server's own connection protocol): security defaults, body limits, connection hygiene, the
worker pool's queue, the served OpenAPI document, and no internal text in a 500."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from fake_engine import FakeEngine  # noqa: E402
from server_support import ThreadedServer  # noqa: E402

from slipstream.server.config import ServerConfig, default_allowed_hosts, host_allowed  # noqa: E402

MSGS = [{"role": "user", "content": "hi"}]


def _raw(port: int, data: bytes, read: bool = True, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out and b"content-length" in out.lower():
                head, _, body = out.partition(b"\r\n\r\n")
                n = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                             if line.lower().startswith(b"content-length")))
                if len(body) >= n:
                    break
        return out


def test_host_rules():
    loop = default_allowed_hosts("127.0.0.1")
    assert host_allowed("127.0.0.1:8000", loop) and host_allowed("localhost:8000", loop)
    assert host_allowed("[::1]:8000", loop) and host_allowed("LOCALHOST", loop)
    assert not host_allowed("evil.example:8000", loop) and not host_allowed("127.0.0.1.nip.io", loop)
    anywhere = default_allowed_hosts("0.0.0.0")
    assert host_allowed("10.1.2.3:80", anywhere) and not host_allowed("rebind.example", anywhere)
    widened = default_allowed_hosts("127.0.0.1", ("api.example.com",))
    assert host_allowed("api.example.com", widened)
    assert host_allowed("whatever", default_allowed_hosts("127.0.0.1", ("*",)))
    assert host_allowed("127.0.0.1:8000", default_allowed_hosts("localhost"))


def test_empty_api_key_is_refused():
    from slipstream.errors import SlipstreamError

    with pytest.raises(SlipstreamError, match="empty"):
        ServerConfig(api_key="")
    with pytest.raises(SlipstreamError, match="empty"):
        ServerConfig(api_key="   ")


def test_security_defaults_and_documents():
    with ThreadedServer(ServerConfig(api_key="k3y")) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as h:
        auth = {"Authorization": "Bearer k3y"}
        # the OpenAPI document and its page are behind the key
        assert h.get("/openapi.json").status_code == 401 and h.get("/docs").status_code == 401
        doc = h.get("/openapi.json", headers=auth).json()
        assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/models"} <= set(doc["paths"])
        assert "swagger" in h.get("/docs", headers=auth).text.lower()
        # JSON endpoints want JSON: text/plain (a CORS "simple request") is refused before anything runs
        r = h.post("/v1/chat/completions", content=json.dumps({"messages": MSGS}), headers={
            **auth, "content-type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        # DNS rebinding: a foreign Host is refused, even with the key
        r = h.get("/v1/models", headers={**auth, "host": "rebound.example:1234"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
        assert h.get("/v1/models", headers={**auth, "host": f"localhost:{srv.port}"}).status_code == 200
        # no CORS unless asked for
        pre = h.options("/v1/models", headers={"origin": "https://site.example",
                                               "access-control-request-method": "GET"})
        assert "access-control-allow-origin" not in pre.headers
        r = h.get("/v1/models", headers={**auth, "origin": "https://site.example"})
        assert "access-control-allow-origin" not in r.headers
        # every response names its request id
        assert r.headers["x-request-id"].startswith("req-")
    with ThreadedServer(ServerConfig(cors_origins=("https://app.example",))) as srv:
        pre = httpx.options(srv.base_url + "/v1/chat/completions", timeout=30, headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "content-type,authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(srv.base_url + "/v1/chat/completions", timeout=30, headers={
            "origin": "https://evil.example", "access-control-request-method": "POST"})
        assert other.headers.get("access-control-allow-origin") != "https://evil.example"
        # open API: the docs are public
        assert httpx.get(srv.base_url + "/openapi.json", timeout=30).status_code == 200


def test_body_limits_answer_before_the_body_is_read():
    cfg = ServerConfig(max_body_bytes=64 * 1024, body_timeout=1.0)
    with ThreadedServer(cfg) as srv:
        # a declared Content-Length over the limit: 413 with only the headers sent
        t0 = time.perf_counter()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {10 ** 10}\r\n\r\n").encode()
        out = _raw(srv.port, head)
        assert out.startswith(b"HTTP/1.1 413"), out[:200]
        # 413, not the body timeout's 408: answered without waiting for a body that never comes (the bound
        # leaves room for a 2-core machine running two test workers)
        assert b"request_too_large" in out and time.perf_counter() - t0 < 5.0
        # a chunked body that grows past the limit: 413 as soon as it does
        def chunks():
            for _ in range(100):
                yield b" " * 16384
        r = httpx.post(srv.base_url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        # a body that never finishes: 408 after the body timeout
        t0 = time.perf_counter()
        out = _raw(srv.port, head.replace(str(10 ** 10).encode(), b"100") + b'{"prompt": ')
        assert out.startswith(b"HTTP/1.1 408"), out[:200]
        assert 0.9 < time.perf_counter() - t0 < 5
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200


def test_slow_headers_are_cut_and_connections_are_capped():
    cfg = ServerConfig(header_timeout=1.0, idle_timeout=0.5, max_connections=4)
    with ThreadedServer(cfg) as srv:
        # slowloris: headers that never end are cut after the header timeout, trickle or not
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            t0 = time.perf_counter()
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            s.settimeout(0.2)
            closed = False
            while time.perf_counter() - t0 < 8 and not closed:
                try:
                    s.sendall(b"X-a: b\r\n")
                    closed = s.recv(100) == b""
                except socket.timeout:
                    pass
                except OSError:
                    closed = True
            assert closed and time.perf_counter() - t0 < 6.0   # cut at the 1 s header timeout, trickle or not
        # the connection cap: the fifth idle connection gets a 503 and is closed
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(4)]
        try:
            time.sleep(0.1)
            out = _raw(srv.port, b"", read=True)
            assert out.startswith(b"HTTP/1.1 503") and b"too_many_connections" in out, out[:200]
            assert b"retry-after" in out.lower()
        finally:
            for s in idle:
                s.close()
        # idle connections were dropped by the header timeout anyway; the server serves again
        time.sleep(0.7)
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200


def test_worker_queue_full_is_503_with_retry_after():
    cfg = ServerConfig(workers=1, max_queued_jobs=1)
    with ThreadedServer(cfg) as srv:
        state = srv.app.state.server
        state.pool.pending = 2          # as if two requests were being prepared
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "a b", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        assert r.headers["retry-after"] == "1"
        state.pool.pending = 0
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "a b", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text


def test_a_500_names_a_request_id_and_hides_the_exception(caplog):
    with ThreadedServer() as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "please explode", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "internal_error" and "tokenizer bug" not in err["message"]
        rid = r.headers["x-request-id"]
        assert rid in err["message"]
        assert any(rid in rec.getMessage() for rec in caplog.records), "the log names the request id"


def test_requests_that_can_never_fit_get_400_with_numbers():
    fake = FakeEngine()
    with ThreadedServer(ServerConfig(max_choices=8), engine=fake) as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": ["a"] * 3, "n": 3, "max_tokens": 1},
                       timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "too_many_choices" and "9" in err["message"], err
        fake.max_waiting = 0            # a full queue passes: 503 with Retry-After
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full" and "retry-after" in r.headers
