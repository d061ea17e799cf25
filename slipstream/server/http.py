"""What stands between a socket and a route: the request guard (pure ASGI) and the connection
protocol (uvicorn's h11 one with a header timeout and a connection cap).

The guard, in order, for every HTTP request:
  request id   every response carries `X-Request-Id`; a 500 names it and the log has the traceback
  Host         checked against the allowed names (DNS rebinding), when the server was given them
  API key      `Authorization: Bearer KEY` on everything but OPEN_PATHS, when a key is set
  POST body    `Content-Type: application/json` (415 otherwise); a declared `Content-Length` over
               the limit is a 413 before any of the body is read; a body that grows past it is a
               413 as soon as it does; a body that takes longer than the body timeout is a 408
  errors       whatever a route raises that is not an APIError is logged with the request id and
               answered 500 `internal_error` without its text
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any

from slipstream.server.config import ServerConfig, host_allowed
from slipstream.server.protocol import APIError, error_body

log = logging.getLogger("slipstream.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})   # no API key needed


def json_error_bytes(body: dict[str, Any]) -> bytes:
    # ASCII-escaped: an error message may quote the client's input, which must never break the encoding
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode()


async def send_error(send: Any, status: int, message: str, code: str, param: str | None = None,
                     type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
    body = json_error_bytes(error_body(message, type, param, code))
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Any, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


class RequestGuard:
    """The checks above, as pure ASGI (streams pass through untouched)."""

    def __init__(self, app: Any, config: ServerConfig):
        self.app = app
        self.cfg = config
        self.key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"req-{uuid.uuid4().hex[:24]}"
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = dict(message, headers=list(message.get("headers", [])) + [(b"x-request-id", rid.encode())])
            await send(message)

        try:
            await self._guarded(scope, receive, send_with_id)
        except Exception:
            log.exception("internal error in %s %s (request id %s)", scope["method"], scope["path"], rid)
            if not started:
                await send_error(send_with_id, 500, f"Internal server error (request id {rid}); the server log "
                                 "has the details.", "internal_error", type="server_error")

    async def _guarded(self, scope: Any, receive: Any, send: Any) -> None:
        cfg = self.cfg
        if cfg.allowed_hosts is not None:
            host = (_header(scope, b"host") or b"").decode("latin-1")
            if host and not host_allowed(host, cfg.allowed_hosts):
                await send_error(send, 400, f"Host {host[:100]!r} is not served here (start the server with "
                                 "--allowed-hosts to accept it).", "host_not_allowed")
                return
        if self.key is not None and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = _header(scope, b"authorization") or b""
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                await send_error(send, 401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                                 "invalid_api_key")
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
            replayed = False

            async def replay() -> Any:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)

    async def _read_body(self, scope: Any, receive: Any, send: Any) -> bytes | None:
        """The whole body, or None once an error has been sent."""
        cfg = self.cfg
        ctype = (_header(scope, b"content-type") or b"").decode("latin-1").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            await send_error(send, 415, f"Content-Type must be application/json, got {ctype[:100] or 'none'!r}.",
                             "unsupported_media_type")
            return None
        limit = cfg.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                n = -1
            if n < 0:
                await send_error(send, 400, "The Content-Length header is not a number.", "invalid_value")
                return None
            if n > limit:
                await send_error(send, 413, f"The request body has {n} bytes; this server takes at most {limit} "
                                 "(--max-body-bytes).", "request_too_large")
                return None
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + cfg.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await send_error(send, 408, f"The request body did not arrive within {cfg.body_timeout:g} s.",
                                 "request_timeout", headers={"Connection": "close"})
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                # (the rest is discarded as it arrives; the header timeout then closes the connection)
                await send_error(send, 413, f"The request body is larger than {limit} bytes (--max-body-bytes).",
                                 "request_too_large")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def protocol_class(config: ServerConfig) -> type:
    """uvicorn's h11 protocol with a header timeout (a connection must finish a request's headers
    within `header_timeout` s of opening or of its previous response) and a connection cap (past
    `max_connections` a new connection is answered 503 and closed)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = json_error_bytes(error_body("Too many open connections; retry shortly.", "server_error", None,
                                       "too_many_connections"))
    busy_response = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                     b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
                     % (config.retry_after_s, len(busy))) + busy

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > config.max_connections:
                transport.write(busy_response)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(config.header_timeout, self._on_header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()          # a request's headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


def api_error_response(e: APIError) -> tuple[int, bytes, dict[str, str]]:
    return e.status, json_error_bytes(e.body()), dict(e.headers or {})
