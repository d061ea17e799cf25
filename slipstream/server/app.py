"""The OpenAI-compatible HTTP API over one `LLM`: `build_app(llm)` and `run_server(llm)`.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /v1/models/{id}
    POST /tokenize   POST /detokenize   GET /health   GET /metrics   GET /version

Every error is OpenAI-shaped JSON, `{"error": {"message", "type", "param", "code"}}`: 400 for bad
input (naming the parameter), 401 for a wrong API key, 404 for an unknown model or route, 503 when
the queue is full or the server is shutting down, 500 only for a bug. Streams are server-sent
events ending in `data: [DONE]`. Each choice of a request (`n`) is its own engine request; a
client that goes away has its requests aborted (their KV blocks freed).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from slipstream.engine.sampling import SamplingParams, TokenLogprobs
from slipstream.errors import PromptTooLongError, QueueFullError, SlipstreamError
from slipstream.server.async_engine import (AsyncEngine, EngineDrainingError, EngineFailedError,
                                            RequestStream)
from slipstream.server.metrics import ServerMetrics
from slipstream.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        TokenizeRequest, bad_request, error_body, parse_request)

log = logging.getLogger("slipstream.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})   # no API key needed
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
LOGPROB_FLOOR = -9999.0   # JSON has no -inf


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _sse(obj: Any) -> bytes:
    return b"data: " + _json_bytes(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# -- token text for logprobs ------------------------------------------------------------------------

class _TokenText:
    """A token's text and exact bytes, as logprobs report them (cached per id)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_of: dict[str, int] | None = None
        decoder = getattr(getattr(tokenizer, "backend", None), "decoder", None)
        if type(decoder).__name__ == "ByteLevel":
            from slipstream.tokenizer import _gpt2_byte_alphabet
            self._byte_of = {c: b for b, c in _gpt2_byte_alphabet().items()}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tok.id_to_token(token_id)
        if raw is not None:
            if self._byte_of is not None and all(c in self._byte_of for c in raw):
                b = bytes(self._byte_of[c] for c in raw)
                return b.decode("utf-8", errors="replace"), list(b)
            if len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):   # SentencePiece byte fallback
                try:
                    b = bytes([int(raw[3:5], 16)])
                    return b.decode("utf-8", errors="replace"), list(b)
                except ValueError:
                    pass
        text = self.tok.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))


def _lp(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


# -- the server's state ---------------------------------------------------------------------------

@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


class _ClientGone(Exception):
    pass


class ServerState:
    def __init__(self, llm: Any, served_model_name: str | None, api_key: str | None):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_id = served_model_name or llm.model_name
        self.model_names = {self.model_id, llm.model_name}
        self.max_model_len: int = llm.max_model_len
        self.api_key = api_key or None
        self.created = int(time.time())
        self.metrics = ServerMetrics(stats=lambda: self.engine.stats())
        self.engine = AsyncEngine(llm.engine, metrics=self.metrics)
        self.token_text = _TokenText(self.tokenizer)

    # -- checks --------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")

    def max_tokens_for(self, n_prompt: int, requested: int | None, what: str, param: str) -> int:
        L = self.max_model_len
        if n_prompt == 0:
            raise bad_request(f"The {what} is empty (0 tokens).", param)
        if n_prompt >= L:
            raise bad_request(f"This model's maximum context length is {L} tokens. However, your {what} "
                              f"resulted in {n_prompt} tokens, which leaves no room for a completion. "
                              f"Please reduce the length of the {what}.", param, "context_length_exceeded")
        if requested is None:
            return L - n_prompt
        if n_prompt + requested > L:
            raise bad_request(f"This model's maximum context length is {L} tokens. However, you requested "
                              f"{n_prompt + requested} tokens ({n_prompt} in the {what}, {requested} in the "
                              f"completion). Please reduce the length of the {what} or completion.",
                              param, "context_length_exceeded")
        return requested

    @staticmethod
    def sampling(req: Any, max_tokens: int, logprobs: int | None, n: int) -> list[SamplingParams]:
        kw = req.sampling_kwargs()
        out = []
        for i in range(n):
            seed = None if req.seed is None else req.seed + i
            try:
                out.append(SamplingParams(max_tokens=max_tokens, seed=seed, logprobs=logprobs, **kw))
            except ValueError as e:
                name = str(e).split(" ", 1)[0]
                raise bad_request(str(e), name if name in type(req).model_fields else None) from None
        return out

    async def submit(self, items: list[tuple[list[int], SamplingParams]], priority: int,
                     param: str) -> RequestStream:
        try:
            return await self.engine.submit(items, priority)
        except EngineDrainingError as e:
            raise APIError(503, str(e), "server_error", None, "server_shutting_down") from None
        except EngineFailedError as e:
            raise APIError(500, str(e), "server_error") from None
        except QueueFullError as e:
            raise APIError(503, f"{e}; retry later", "server_error", None, "queue_full") from None
        except PromptTooLongError as e:
            raise bad_request(str(e), param, "context_length_exceeded") from None
        except (SlipstreamError, ValueError) as e:
            raise bad_request(str(e), param) from None

    # -- logprobs formats ----------------------------------------------------------------------
    def chat_logprobs(self, lps: list[TokenLogprobs]) -> list[dict[str, Any]]:
        out = []
        for lp in lps:
            text, b = self.token_text(lp.token_id)
            top = []
            for tid, v in lp.top:
                t2, b2 = self.token_text(tid)
                top.append({"token": t2, "logprob": _lp(v), "bytes": b2})
            out.append({"token": text, "logprob": _lp(lp.logprob), "bytes": b, "top_logprobs": top})
        return out

    def completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> tuple[dict[str, Any], int]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text, _ = self.token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(_lp(lp.logprob))
            top = {self.token_text(tid)[0]: _lp(v) for tid, v in lp.top}
            top.setdefault(text, _lp(lp.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


# -- helpers for the handlers -----------------------------------------------------------------------

async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it and raise _ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise _ClientGone()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _collect(request: Request, stream: RequestStream, n: int) -> list[_Choice]:
    choices = [_Choice() for _ in range(n)]

    async def run() -> None:
        async for ev in stream:
            c = choices[ev.index]
            c.text.append(ev.text)
            c.token_ids += ev.token_ids
            c.logprobs += ev.logprobs
            if ev.finish_reason is not None:
                c.finish_reason = ev.finish_reason

    try:
        await _until_disconnect(request, run())
    except EngineDrainingError as e:
        raise APIError(503, str(e), "server_error", None, "server_shutting_down") from None
    except EngineFailedError as e:
        raise APIError(500, str(e), "server_error") from None
    finally:
        stream.close()
    return choices


class _APIKeyMiddleware:
    """Every route but OPEN_PATHS needs `Authorization: Bearer <key>` (pure ASGI: streams pass untouched)."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = JSONResponse(
                    error_body("Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                               "invalid_request_error", None, "invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _EventStream(StreamingResponse):
    """An SSE response that aborts its requests however it ends (done, client gone, cancelled)."""

    def __init__(self, body: AsyncIterator[bytes], stream: RequestStream):
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._stream = stream
        self._body = body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()
            aclose = getattr(self._body, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    pass


def _stream_error(e: BaseException) -> bytes:
    return _sse(error_body(str(e), "server_error"))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# -- the app -------------------------------------------------------------------------------------

def build_app(llm: Any, *, served_model_name: str | None = None, api_key: str | None = None,
              drain_timeout: float | None = None) -> FastAPI:
    """The FastAPI app over `llm` (a `slipstream.LLM`). Its lifespan starts the engine thread and,
    at shutdown, drains in-flight requests (up to `drain_timeout` seconds) and stops it."""
    S = ServerState(llm, served_model_name, api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        S.engine.start()
        try:
            yield
        finally:
            await S.engine.shutdown(drain_timeout)

    app = FastAPI(title="Slipstream", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.server = S

    # -- errors --------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            msg, code = f"Invalid URL ({request.method} {request.url.path})", "not_found"
        elif e.status_code == 405:
            msg, code = f"Method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            msg, code = str(e.detail), None
        return JSONResponse(error_body(msg, "invalid_request_error", None, code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        # (Starlette re-raises it after this response is sent, so the server logs the traceback)
        return JSONResponse(error_body(f"Internal server error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)

    if S.api_key is not None:
        app.add_middleware(_APIKeyMiddleware, api_key=S.api_key)

    # -- plain routes --------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not S.engine.is_running:
            return JSONResponse(error_body("the engine is not running", "server_error"), status_code=503)
        if not S.engine.accepting:
            return JSONResponse(error_body("the server is shutting down", "server_error"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from slipstream import __version__
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(S.metrics.render(), media_type=S.metrics.content_type)

    def _model_card() -> dict[str, Any]:
        return {"id": S.model_id, "object": "model", "created": S.created, "owned_by": "slipstream",
                "root": llm.model_name, "parent": None, "max_model_len": S.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        S.check_model(model)
        return _model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_request(TokenizeRequest, await request.body())
        S.check_model(req.model)
        if req.messages is not None:
            msgs = [m.as_template_message() for m in req.messages]
            try:
                text = S.tokenizer.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt)
            except Exception as e:
                raise bad_request(f"could not render the chat template: {e}", "messages") from None
            special = False if req.add_special_tokens is None else req.add_special_tokens
        else:
            text = req.prompt
            special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = S.tokenizer.encode(text, add_special_tokens=special)
        return {"tokens": ids, "count": len(ids), "max_model_len": S.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_request(DetokenizeRequest, await request.body())
        S.check_model(req.model)
        vocab = S.tokenizer.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {req.tokens[bad]} is outside the vocabulary (0..{vocab - 1})",
                              f"tokens[{bad}]")
        return {"prompt": S.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    # -- chat completions ------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await request.body())
        S.check_model(req.model)
        msgs = [m.as_template_message() for m in req.messages]
        try:
            prompt = llm.chat_prompt(msgs)
        except Exception as e:
            raise bad_request(f"could not render the chat template: {e}", "messages") from None
        ids = S.tokenizer.encode(prompt, add_special_tokens=False)
        max_tokens = S.max_tokens_for(len(ids), req.requested_max_tokens, "messages", "messages")
        params = S.sampling(req, max_tokens, req.num_logprobs, req.n)
        stream = await S.submit([(ids, p) for p in params], req.priority, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return _EventStream(_chat_stream(req, stream, rid, created, len(ids)), stream)
        try:
            choices = await _collect(request, stream, req.n)
        except _ClientGone:
            return Response(status_code=499)
        out = []
        for i, c in enumerate(choices):
            lp = {"content": S.chat_logprobs(c.logprobs), "refusal": None} if req.logprobs else None
            out.append({"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": lp, "finish_reason": c.finish_reason})
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": S.model_id, "choices": out,
            "usage": _usage(len(ids), sum(len(c.token_ids) for c in choices))})

    async def _chat_stream(req: ChatCompletionRequest, stream: RequestStream, rid: str, created: int,
                           n_prompt: int) -> AsyncIterator[bytes]:
        usage_on = req.include_usage
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": S.model_id}

        def chunk(index: int, delta: dict[str, Any], finish: str | None, lp: Any = None) -> bytes:
            obj = dict(head, choices=[{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}])
            if usage_on:
                obj["usage"] = None
            return _sse(obj)

        completion_tokens = 0
        try:
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""}, None)
            async for ev in stream:
                completion_tokens += len(ev.token_ids)
                lp = ({"content": S.chat_logprobs(ev.logprobs), "refusal": None}
                      if req.logprobs and ev.token_ids else None)
                if ev.text or (lp is not None and not ev.finished):
                    yield chunk(ev.index, {"content": ev.text}, None, lp)
                    lp = None
                if ev.finished:
                    yield chunk(ev.index, {}, ev.finish_reason, lp)
            if usage_on:
                yield _sse(dict(head, choices=[], usage=_usage(n_prompt, completion_tokens)))
        except (EngineFailedError, EngineDrainingError) as e:
            yield _stream_error(e)
        yield SSE_DONE

    # -- completions -----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await request.body())
        S.check_model(req.model)
        items: list[tuple[list[int], SamplingParams]] = []
        n_prompt = 0
        prompts = req.prompts()
        for k, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            ids = S.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            max_tokens = S.max_tokens_for(len(ids), req.max_tokens, "prompt", param)
            items += [(ids, sp) for sp in S.sampling(req, max_tokens, req.logprobs, req.n)]
            n_prompt += len(ids)
        stream = await S.submit(items, req.priority, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return _EventStream(_completion_stream(req, stream, rid, created, n_prompt, len(items)), stream)
        try:
            choices = await _collect(request, stream, len(items))
        except _ClientGone:
            return Response(status_code=499)
        out = []
        for i, c in enumerate(choices):
            lp = S.completion_logprobs(c.logprobs, 0)[0] if req.logprobs is not None else None
            out.append({"index": i, "text": "".join(c.text), "logprobs": lp, "finish_reason": c.finish_reason})
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": S.model_id, "choices": out,
            "usage": _usage(n_prompt, sum(len(c.token_ids) for c in choices))})

    async def _completion_stream(req: CompletionRequest, stream: RequestStream, rid: str, created: int,
                                 n_prompt: int, n_choices: int) -> AsyncIterator[bytes]:
        usage_on = req.include_usage
        head = {"id": rid, "object": "text_completion", "created": created, "model": S.model_id}
        offsets = [0] * n_choices
        completion_tokens = 0
        try:
            async for ev in stream:
                completion_tokens += len(ev.token_ids)
                lp = None
                if req.logprobs is not None and ev.token_ids:
                    lp, offsets[ev.index] = S.completion_logprobs(ev.logprobs, offsets[ev.index])
                if ev.text or ev.finished or lp is not None:
                    obj = dict(head, choices=[{"index": ev.index, "text": ev.text, "logprobs": lp,
                                               "finish_reason": ev.finish_reason}])
                    if usage_on:
                        obj["usage"] = None
                    yield _sse(obj)
            if usage_on:
                yield _sse(dict(head, choices=[], usage=_usage(n_prompt, completion_tokens)))
        except (EngineFailedError, EngineDrainingError) as e:
            yield _stream_error(e)
        yield SSE_DONE

    return app


# -- running it -------------------------------------------------------------------------------------

def run_server(llm: Any, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, log_level: str = "info", access_log: bool = True,
               drain_timeout: float | None = None) -> None:
    """Serve until SIGINT/SIGTERM: then stop taking connections, let in-flight requests finish
    (`drain_timeout` seconds at most, None = no limit), stop the engine and return."""
    import uvicorn

    app = build_app(llm, served_model_name=served_model_name, api_key=api_key, drain_timeout=drain_timeout)
    state: ServerState = app.state.server

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            state.engine.stop_accepting()   # requests that still reach us get 503 while we drain
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            lifespan="on", timeout_graceful_shutdown=drain_timeout, server_header=False)
    server = _Server(config)
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
