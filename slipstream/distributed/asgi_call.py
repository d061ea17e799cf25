"""One HTTP request through an ASGI app in this process, its response as a stream of parts.

A replica runs the single server's app (`server.app.build_app`) unchanged and takes requests that
the ingress forwards as plain values; this is the bridge. The first part is the response head
(`{"status": int, "headers": [[name, value], ...]}`), the rest are body chunks (bytes). When the
consumer stops early (the client went away, the call was cancelled) the app sees a disconnect
and is cancelled, so its requests are aborted in the engine as they are in the single server.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

_END = object()


@dataclass
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None

    def scope(self) -> dict[str, Any]:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "query_string": self.query_string, "root_path": "", "headers": list(self.headers),
                "client": self.client, "server": ("127.0.0.1", 0), "state": {}}


async def call_asgi(app: Any, req: ForwardedRequest) -> AsyncIterator[dict[str, Any] | bytes]:
    """Yields the response head, then its body chunks, as the app sends them."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if disconnected.is_set():
            raise OSError("the client went away")
        await queue.put(message)

    async def run() -> None:
        try:
            await app(req.scope(), receive, send)
        except BaseException as e:   # handed to the consumer (the guard has already answered bugs)
            await queue.put(e)
        finally:
            await queue.put(_END)

    task = asyncio.ensure_future(run())
    complete = False
    try:
        while True:
            msg = await queue.get()
            if msg is _END:
                complete = True
                return
            if isinstance(msg, BaseException):
                raise msg
            if msg["type"] == "http.response.start":
                headers = [[bytes(k), bytes(v)] for k, v in msg.get("headers", [])]
                yield {"status": int(msg["status"]), "headers": headers}
            elif msg["type"] == "http.response.body":
                chunk = bytes(msg.get("body", b""))
                if chunk:
                    yield chunk
                if not msg.get("more_body", False):
                    complete = True
                    return
    finally:
        if complete:    # let the app finish its own clean-up (closing its stream)
            await asyncio.wait({task}, timeout=5.0)
        disconnected.set()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
