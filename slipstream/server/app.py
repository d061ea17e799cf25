"""The OpenAI-compatible HTTP API over one `LLM`: `build_app(llm, config)` and `run_server(llm, config)`.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /v1/models/{id}
    POST /tokenize   POST /detokenize   GET /health   GET /metrics   GET /version
    GET /openapi.json   GET /docs   GET / (the chat page; its files under /static/)

Every error is OpenAI-shaped JSON, `{"error": {"message", "type", "param", "code"}}` with a stable
`code` (protocol.ERROR_CODES): 4xx for anything about the request (400 names the parameter, and
the numbers when a request can never fit), 503 with `Retry-After` only for conditions that pass
(a full queue, a busy worker pool, a shutdown), 500 only for a bug, logged with the request id
that the response names. Streams are server-sent events ending in `data: [DONE]`; a stream the
server has to cut ends with an `error` event, then `[DONE]`. Each choice of a request (`n`) is its
own engine request; a client that goes away has its requests aborted (their KV blocks freed).

The chat page (`static/`: plain HTML, CSS and JS modules, no build step, nothing fetched from
elsewhere) is served without the API key, since it holds no data and the API calls it makes send the
key, but through the same Host check; its files are read once at start-up.

The layers: http.py (request guard, connection protocol) -> routes.py (one function per route
over state.py's AppState; CPU work on the worker pool) -> streaming.py (one SSE path) ->
async_engine.py (the engine thread, typed messages).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import threading
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from slipstream.errors import SlipstreamError
from slipstream.server.config import ServerConfig, default_allowed_hosts
from slipstream.server.http import RequestGuard, json_error_bytes, protocol_class, send_error
from slipstream.server.openapi import docs_html, openapi_document
from slipstream.server.protocol import APIError, error_body
from slipstream.server.routes import ROUTES
from slipstream.server.state import AppState

log = logging.getLogger("slipstream.server")


# -- the chat page ------------------------------------------------------------------------------------

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PREFIX = "/static/"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# the page runs only its own files and talks only to this server: no inline script, no other origin
PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",        # always revalidated (ETag): a new version of the page shows at once
}


class ChatPage:
    """The files of `directory` as an ASGI app: `/` is index.html, `/static/NAME` the others (flat,
    only the known types), each with its content type, an ETag and `PAGE_HEADERS`; GET and HEAD only."""

    def __init__(self, directory: Path = STATIC_DIR):
        self.files: dict[str, tuple[bytes, str, str]] = {}     # path -> (body, content type, etag)
        for f in sorted(directory.iterdir()) if directory.is_dir() else ():
            ctype = CONTENT_TYPES.get(f.suffix)
            if ctype is None or not f.is_file():
                continue
            body = f.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
            self.files["/" if f.name == "index.html" else STATIC_PREFIX + f.name] = (body, ctype, etag)

    @staticmethod
    def serves(path: str) -> bool:
        return path == "/" or path.startswith(STATIC_PREFIX)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path, method = scope["path"], scope["method"]
        found = self.files.get(path)
        if found is None:
            await send_error(send, 404, f"Invalid URL ({method} {path[:200]})", "not_found")
            return
        if method not in ("GET", "HEAD"):
            await send_error(send, 405, f"Method {method} is not allowed on {path[:200]}", "method_not_allowed",
                             headers={"Allow": "GET, HEAD"})
            return
        body, ctype, etag = found
        headers = [(k.encode(), v.encode()) for k, v in PAGE_HEADERS.items()] + [(b"etag", etag.encode())]
        if_none_match = next((v for k, v in scope["headers"] if k == b"if-none-match"), b"").decode("latin-1")
        if etag in (t.strip() for t in if_none_match.split(",")) or if_none_match.strip() == "*":
            await send({"type": "http.response.start", "status": 304, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        headers += [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})


class PageRouter:
    """Middleware outside the request guard: requests for the chat page go to it through a guard
    without the API key (the Host check and the rest still apply); everything else goes on to the API."""

    def __init__(self, app: Any, config: ServerConfig, page: ChatPage):
        self.app = app
        self.page = page
        self.open_guard = RequestGuard(page, replace(config, api_key=None))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.page.serves(scope["path"]):
            await self.open_guard(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _endpoint(S: AppState, route: Any) -> Any:
    async def endpoint(request: Request) -> Response:
        return await route(S, request)
    endpoint.__name__ = route.__name__
    return endpoint


async def _api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, APIError)
    return Response(json_error_bytes(e.body()), status_code=e.status, media_type="application/json",
                    headers=e.headers)


async def _http_error(request: Request, e: Exception) -> Response:
    """Starlette's own 404 / 405 (no such route, wrong method) as OpenAI-shaped errors."""
    assert isinstance(e, StarletteHTTPException)
    if e.status_code == 404:
        msg, code = f"Invalid URL ({request.method} {request.url.path[:200]})", "not_found"
    elif e.status_code == 405:
        msg, code = f"Method {request.method} is not allowed on {request.url.path[:200]}", "method_not_allowed"
    else:
        msg, code = str(e.detail), None
    return Response(json_error_bytes(error_body(msg, "invalid_request_error", None, code)),
                    status_code=e.status_code, media_type="application/json", headers=getattr(e, "headers", None))


def build_app(llm: Any, config: ServerConfig | None = None, *, served_model_name: str | None = None,
              api_key: str | None = None, drain_timeout: float | None = None) -> Starlette:
    """The ASGI app over `llm` (a `slipstream.LLM`). Its lifespan starts the engine thread and, at
    shutdown, drains in-flight requests (up to the drain timeout) and stops it. The keyword
    arguments are shorthands for the matching `ServerConfig` fields when no config is given."""
    if config is None:
        config = ServerConfig(api_key=api_key, served_model_name=served_model_name, drain_timeout=drain_timeout)
    S = AppState(llm, config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        S.engine.start()
        try:
            yield
        finally:
            await S.engine.shutdown(config.drain_timeout)
            S.pool.shutdown()

    from slipstream import __version__
    spec = openapi_document("Slipstream", __version__, config.api_key is not None)
    spec_bytes = json_error_bytes(spec)
    docs = docs_html()

    async def openapi(request: Request) -> Response:
        return Response(spec_bytes, media_type="application/json")

    async def swagger(request: Request) -> Response:
        return HTMLResponse(docs)

    routes = [Route(path, _endpoint(S, fn), methods=[method]) for method, path, fn in ROUTES]
    routes += [Route("/openapi.json", openapi, methods=["GET"]), Route("/docs", swagger, methods=["GET"])]

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, StarletteHTTPException: _http_error})
    app.state.server = S
    app.add_middleware(RequestGuard, config=config)
    app.add_middleware(PageRouter, config=config, page=ChatPage())
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Request-Id"])
    return app


# -- running it -------------------------------------------------------------------------------------

def run_server(llm: Any, config: ServerConfig | None = None, *, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", access_log: bool = True, allowed_hosts: tuple[str, ...] = (),
               check_host: bool = True, **shorthands: Any) -> None:
    """Serve until SIGINT/SIGTERM, then drain: new requests get 503 (and /health says 503) while
    the listener stays open and in-flight requests finish, for at most `config.drain_timeout`
    seconds (None: no limit); streams still running then end with an SSE error event and
    `[DONE]`. A second signal stops at once. `allowed_hosts` widens the Host names accepted
    beyond the bound address ("*": any); `check_host=False` turns the check off."""
    import uvicorn

    if config is None:
        config = ServerConfig(**shorthands)
    if check_host and config.allowed_hosts is None:
        from dataclasses import replace
        config = replace(config, allowed_hosts=default_allowed_hosts(host, allowed_hosts))
    app = build_app(llm, config)
    state: AppState = app.state.server

    class _Server(uvicorn.Server):
        drain_requested = False
        drain_task: asyncio.Task | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.drain_requested:    # the first signal: drain
                self.drain_requested = True
                state.draining = True
                state.engine.stop_accepting()
            else:                           # the second: stop now
                super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:   # listening: say where the chat page is (the port bound, when 0 was asked)
                bound = next((s.getsockname()[1] for srv in self.servers for s in srv.sockets), port)
                shown = f"[{host}]" if ":" in host else host
                logging.getLogger("uvicorn.error").info("Chat page: http://%s:%d/ (open it in a browser)",
                                                        shown, bound)

        async def on_tick(self, counter: int) -> bool:
            if self.drain_requested and self.drain_task is None:
                self.drain_task = asyncio.create_task(_drain(state, config.drain_timeout))
            if self.drain_task is not None and self.drain_task.done():
                return True
            return await super().on_tick(counter)

    uconfig = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="on",
                             http=protocol_class(config),
                             timeout_keep_alive=config.idle_timeout,  # type: ignore[arg-type]
                             timeout_graceful_shutdown=5, server_header=False)
    server = _Server(uconfig)
    # uvicorn re-raises the signal it stopped on once it has restored the handlers it found; with
    # these no-op handlers in place a graceful shutdown ends with a normal return (exit code 0).
    handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {sig: signal.getsignal(sig) for sig in handled}
    for sig in handled:
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    except SystemExit:   # uvicorn exits when it cannot bind (it has logged why)
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise SlipstreamError(f"could not start the server on {host}:{port} (see the log above)")


async def _drain(state: AppState, timeout: float | None) -> None:
    n = state.engine.num_inflight
    log.info("draining: %d request(s) in flight; %s", n,
             "no time limit" if timeout is None else f"up to {timeout:g} s")
    if await state.engine.drain(timeout):
        return
    log.warning("drain timeout: cutting %d request(s) still running", state.engine.num_inflight)
    state.engine.cut_all()
    await state.engine.drain(10.0)    # each cut stream writes its error event and [DONE]
    await asyncio.sleep(0.1)
