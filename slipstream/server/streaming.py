"""One way out for generated tokens, shared by chat and completions.

An endpoint describes its output with a `Shape`: the response head (id, object, created, model),
the choices it opens a stream with (chat's role deltas) and how one engine event becomes choice
objects. `event_stream` writes any shape as server-sent events ending in `data: [DONE]` (an engine
failure or a shutdown that cuts the stream becomes an `error` event first); `collect` gathers the
events of a non-streamed request per choice.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from slipstream.engine.sampling import TokenLogprobs
from slipstream.server.async_engine import EngineDrainingError, EngineFailedError, RequestStream, StreamEvent
from slipstream.server.protocol import APIError, error_body

log = logging.getLogger("slipstream.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", errors="replace")


def sse(obj: Any) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Shape:
    """How one endpoint's stream looks."""

    head: dict[str, Any]                                  # id, object, created, model
    render: Callable[[StreamEvent], list[dict[str, Any]]]   # one event -> its choice objects
    opening: list[dict[str, Any]] = field(default_factory=list)   # choices sent before any token
    include_usage: bool = False
    n_prompt: int = 0


def stream_error(e: BaseException, request_id: str) -> bytes:
    if isinstance(e, EngineDrainingError):
        body = error_body(str(e), "server_error", None, "server_shutting_down")
    elif isinstance(e, EngineFailedError):
        body = error_body(f"{e} (request id {request_id})", "server_error", None, "internal_error")
    else:
        body = error_body(f"Internal server error (request id {request_id}); the server log has the details.",
                          "server_error", None, "internal_error")
    return sse(body)


async def event_stream(shape: Shape, stream: RequestStream, request_id: str) -> AsyncIterator[bytes]:
    def frame(choices: list[dict[str, Any]]) -> bytes:
        obj = dict(shape.head, choices=choices)
        if shape.include_usage:
            obj["usage"] = None
        return sse(obj)

    completion_tokens = 0
    try:
        for choice in shape.opening:
            yield frame([choice])
        async for ev in stream:
            completion_tokens += len(ev.token_ids)
            for choice in shape.render(ev):
                yield frame([choice])
        if shape.include_usage:
            yield sse(dict(shape.head, choices=[], usage=usage(shape.n_prompt, completion_tokens)))
    except (EngineFailedError, EngineDrainingError) as e:
        yield stream_error(e, request_id)
    except Exception as e:   # a bug: logged, the client gets an error event without its text
        log.exception("stream failed (request id %s)", request_id)
        yield stream_error(e, request_id)
    yield SSE_DONE


class SSEResponse(StreamingResponse):
    """A server-sent-events response over `body` that aborts `stream`'s requests however it ends
    (done, client gone, cancelled)."""

    def __init__(self, body: AsyncIterator[bytes], stream: RequestStream):
        self._body = body
        super().__init__(self._body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()
            try:
                await self._body.aclose()  # type: ignore[attr-defined]
            except Exception:
                pass


class EventStreamResponse(SSEResponse):
    """The chat / completions stream of a `Shape`."""

    def __init__(self, shape: Shape, stream: RequestStream, request_id: str):
        super().__init__(event_stream(shape, stream, request_id), stream)


# -- not streamed -------------------------------------------------------------------------------

@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


class ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def collect(request: Request, stream: RequestStream, n: int, retry_after_s: int = 1) -> list[Choice]:
    choices = [Choice() for _ in range(n)]

    async def run() -> None:
        async for ev in stream:
            c = choices[ev.index]
            c.text.append(ev.text)
            c.token_ids += ev.token_ids
            c.logprobs += ev.logprobs
            if ev.finish_reason is not None:
                c.finish_reason = ev.finish_reason

    try:
        await until_disconnect(request, run())
    except EngineDrainingError as e:
        raise APIError(503, str(e), "server_error", None, "server_shutting_down",
                       {"Retry-After": str(retry_after_s)}) from None
    except EngineFailedError as e:
        raise APIError(500, str(e), "server_error", None, "internal_error") from None
    finally:
        stream.close()
    return choices
