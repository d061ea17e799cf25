"""The one endpoint in front of the replicas (an ASGI app, run by uvicorn behind the single
server's request guard and connection protocol).

    /health     200 with {"replicas_ready", "replicas_total", "replicas": [...]} while at least one
                replica is ready; 503 (with Retry-After) when none is, or while draining
    /metrics    every replica's metrics with a `replica` label, their totals, and the router's own
    anything else   forwarded whole to a replica, whose server (the single server's app) answers it;
                chat and completion requests go where the router says, the rest to the least loaded

A request whose replica fails before any byte of its answer was sent (the replica died, its process
was killed) is sent to another ready replica; one whose stream had started ends with an SSE `error`
event and `[DONE]`. A client that goes away cancels its call, which aborts its requests in the
replica's engine.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from slipstream.distributed.asgi_call import ForwardedRequest
from slipstream.distributed.metrics import aggregate
from slipstream.distributed.prompt_key import ROUTED_PATHS
from slipstream.distributed.router import Decision, PromptKey, Router
from slipstream.server.protocol import error_body

log = logging.getLogger("slipstream.distributed")
SSE_DONE = b"data: [DONE]\n\n"


class Replica(Protocol):
    """What the ingress needs of one replica (a Ray Serve deployment handle behind it)."""

    def stream(self, request: ForwardedRequest) -> AsyncIterator[dict[str, Any] | bytes]: ...

    async def info(self) -> dict[str, Any]: ...

    async def metrics(self) -> str: ...


class ReplicaFailed(Exception):
    """A replica could not answer (its process died, it is restarting, its call failed)."""


@dataclass
class ReplicaView:
    ready: bool = False
    info: dict[str, Any] | None = None
    last_error: str | None = None


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


async def _send_json(send: Any, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
    data = _json(body)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


class Ingress:
    def __init__(self, replicas: list[Replica], router: Router, key_of: Callable[[str, bytes], PromptKey | None],
                 retry_after_s: int = 1, health_period_s: float = 1.0, health_timeout_s: float = 5.0):
        self.replicas = replicas
        self.router = router
        self.key_of = key_of
        self.retry_after_s = retry_after_s
        self.health_period_s = health_period_s
        self.health_timeout_s = health_timeout_s
        self.views = [ReplicaView() for _ in replicas]
        self.draining = False
        self.inflight = 0
        self._forwards: set[asyncio.Future] = set()
        self._cutting = False
        self._poller: asyncio.Task | None = None
        r = self.registry = CollectorRegistry()
        self.m_routed = Counter("slipstream_router_requests", "Requests routed, by replica and reason.",
                                ["replica", "reason"], registry=r)
        self.m_retries = Counter("slipstream_router_retries", "Requests sent to another replica after one failed.",
                                 registry=r)
        self.m_cut = Counter("slipstream_router_streams_cut", "Streams ended with an error event: their replica "
                             "failed mid-stream.", registry=r)
        self.m_ready = Gauge("slipstream_replicas_ready", "Replicas ready to serve.", registry=r)
        self.m_total = Gauge("slipstream_replicas_total", "Replicas deployed.", registry=r)
        self.m_inflight = Gauge("slipstream_router_inflight", "Requests in flight, by replica.", ["replica"],
                                registry=r)
        self.m_total.set(len(replicas))

    # -- health -------------------------------------------------------------------------------------
    async def poll_once(self) -> None:
        async def one(i: int) -> None:
            v = self.views[i]
            try:
                info = await asyncio.wait_for(self.replicas[i].info(), self.health_timeout_s)
            except (Exception, asyncio.TimeoutError) as e:   # dead, restarting or stuck
                v.ready, v.last_error = False, f"{type(e).__name__}: {str(e)[:200]}"
                self.router.set_ready(i, False)
                return
            v.info, v.ready, v.last_error = info, bool(info.get("ready")), None
            self.router.set_ready(i, v.ready, info.get("generation"))
        await asyncio.gather(*(one(i) for i in range(len(self.replicas))))
        self.m_ready.set(self.router.num_ready)

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:
                log.exception("health poll failed")
            await asyncio.sleep(self.health_period_s)

    async def wait_ready(self, timeout: float) -> bool:
        """Poll until every replica is ready (True) or `timeout` passes (False)."""
        deadline = time.monotonic() + timeout
        while True:
            await self.poll_once()
            if self.router.num_ready == len(self.replicas):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.ensure_future(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None

    def health(self) -> tuple[int, dict[str, Any]]:
        ready = self.router.num_ready
        reps = []
        for i, v in enumerate(self.views):
            info = v.info or {}
            st = self.router.replicas[i]
            reps.append({"replica": i, "ready": v.ready, "pid": info.get("pid"), "node": info.get("node"),
                         "generation": info.get("generation"), "inflight": st.inflight, "routed": st.routed,
                         "error": v.last_error})
        body = {"status": "ok" if ready and not self.draining else "unavailable", "replicas_ready": ready,
                "replicas_total": len(self.replicas), "router": self.router.policy, "replicas": reps}
        return (200 if ready and not self.draining else 503), body

    # -- ASGI -------------------------------------------------------------------------------------
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health" and scope["method"] == "GET":
            status, body = self.health()
            await _send_json(send, status, body, None if status == 200 else {"Retry-After": str(self.retry_after_s)})
            return
        if path == "/metrics" and scope["method"] == "GET":
            await self._metrics(send)
            return
        if self.draining:
            await _send_json(send, 503, error_body("the server is shutting down", "server_error", None,
                                                   "server_shutting_down"), {"Retry-After": str(self.retry_after_s)})
            return
        raw = await _read_body(receive)
        if raw is None:
            return
        request = ForwardedRequest(scope["method"], path, scope.get("query_string", b""),
                                   [(bytes(k), bytes(v)) for k, v in scope["headers"]], raw,
                                   tuple(scope["client"]) if scope.get("client") else None)
        key = None
        if scope["method"] == "POST" and path in ROUTED_PATHS:
            key = await asyncio.get_running_loop().run_in_executor(None, self.key_of, path, raw)
        self.inflight += 1
        forward = asyncio.ensure_future(self._forward(request, key, send))
        self._forwards.add(forward)
        forward.add_done_callback(self._forwards.discard)
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({forward, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (forward, watcher):
                if not t.done():
                    t.cancel()
            await asyncio.gather(forward, watcher, return_exceptions=True)
            self.inflight -= 1
        if forward.done() and not forward.cancelled() and forward.exception() is not None:
            raise forward.exception()   # type: ignore[misc]

    def cut_all(self) -> None:
        """End every request in flight now (the drain timeout passed): streams get an SSE error event
        and [DONE], requests not yet answered a 503."""
        self._cutting = True
        for f in list(self._forwards):
            f.cancel()

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _metrics(self, send: Any) -> None:
        async def one(i: int) -> tuple[int, str | None]:
            try:
                return i, await asyncio.wait_for(self.replicas[i].metrics(), self.health_timeout_s)
            except (Exception, asyncio.TimeoutError):
                return i, None
        results = await asyncio.gather(*(one(i) for i in range(len(self.replicas))))
        for i, st in enumerate(self.router.replicas):
            self.m_inflight.labels(str(i)).set(st.inflight)
        self.m_ready.set(self.router.num_ready)
        text = aggregate({i: t for i, t in results if t is not None}, generate_latest(self.registry).decode())
        data = text.encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    # -- forwarding ---------------------------------------------------------------------------------
    async def _forward(self, request: ForwardedRequest, key: PromptKey | None, send: Any) -> None:
        tried: list[int] = []
        while True:
            decision = self.router.choose(key, tried)
            if decision is None:
                why = "no replica is ready" if not tried else \
                    f"the replica(s) {', '.join(map(str, tried))} failed and no other is ready"
                await _send_json(send, 503, error_body(f"{why}; retry shortly", "server_error", None,
                                                       "replica_unavailable"),
                                 {"Retry-After": str(self.retry_after_s)})
                return
            self.m_routed.labels(str(decision.replica), decision.reason).inc()
            self.router.started(decision, key)
            try:
                sent = await self._relay(decision, request, send)
            finally:
                self.router.finished(decision, key)
            if sent is None:
                return
            tried.append(decision.replica)
            self.m_retries.inc()

    async def _relay(self, decision: Decision, request: ForwardedRequest, send: Any) -> bool | None:
        """Relay one replica's answer. None: done (answered, or cut mid-stream with an error event);
        False: the replica failed before anything was sent (the caller tries another)."""
        i = decision.replica
        head: dict[str, Any] | None = None
        started = False
        sse = False
        gen = self.replicas[i].stream(request)
        try:
            async for part in gen:
                if isinstance(part, dict):
                    head = part
                    continue
                if not started:
                    sse = await self._start(send, head)
                    started = True
                await send({"type": "http.response.body", "body": part, "more_body": True})
            if not started:
                await self._start(send, head)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return None
        except asyncio.CancelledError:
            if self._cutting:   # shutting down: end the answer cleanly, then stop
                if not started:
                    await _send_json(send, 503, error_body("the server shut down before the request was "
                                                           "answered", "server_error", None,
                                                           "server_shutting_down"),
                                     {"Retry-After": str(self.retry_after_s)})
                else:
                    if sse:
                        err = error_body("the server shut down before the request finished", "server_error",
                                         None, "server_shutting_down")
                        await send({"type": "http.response.body",
                                    "body": b"data: " + _json(err) + b"\n\n" + SSE_DONE, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            raise
        except ReplicaFailed as e:
            self.views[i].ready = False
            self.views[i].last_error = str(e)[:200]
            self.router.set_ready(i, False)
            if not started:
                log.warning("replica %d failed before answering (%s); trying another", i, e)
                return False
            log.warning("replica %d failed mid-answer (%s); ending the stream", i, e)
            self.m_cut.inc()
            if sse:
                err = error_body(f"replica {i} failed while streaming this answer; the request was not "
                                 "completed", "server_error", None, "replica_failed")
                await send({"type": "http.response.body", "body": b"data: " + _json(err) + b"\n\n" + SSE_DONE,
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return None
        finally:
            close = getattr(gen, "aclose", None)
            if close is not None:
                await close()

    async def _start(self, send: Any, head: dict[str, Any] | None) -> bool:
        if head is None:
            raise ReplicaFailed("the replica answered without a response head")
        headers = [(bytes(k), bytes(v)) for k, v in head["headers"] if bytes(k).lower() != b"x-request-id"]
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        await send({"type": "http.response.start", "status": head["status"], "headers": headers})
        return sse


async def _read_body(receive: Any) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
