"""The engine on a thread of its own, with an asyncio face.

The `Engine` is not thread-safe, so one daemon thread owns it: it takes submissions and aborts
from an inbox (a list under a `threading.Condition`; with nothing to do the thread sleeps on the
condition, so an idle server uses no CPU), runs `engine.step()` while anything is unfinished,
and hands each step's events to the event loop in one `loop.call_soon_threadsafe` call, which
puts them on the per-submission `asyncio.Queue`s.

    stream = await async_engine.submit([(ids, params)] * n)   # validation errors raise here
    async for ev in stream: ...                                # StreamEvent, in engine order
    stream.close()                                             # aborts what is unfinished

`Request` objects are mutated by the engine thread, so what a consumer needs from them
(finish_reason, token counts) is snapshotted into each `StreamEvent` on the engine thread; the
`request` itself is safe to read only once its final event has arrived. Prometheus observations
(TTFT, inter-token latency, e2e, queue time, token counters) are made on the engine thread too.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar, Union

from slipstream.engine.request import Request
from slipstream.engine.sampling import SamplingParams, TokenLogprobs

log = logging.getLogger("slipstream.server")
T = TypeVar("T")

# a step that returns nothing this fast did nothing: wait a little (or for new work) before the next
_NOOP_STEP_S = 2e-4
_NOOP_BACKOFF_S = 1e-3


def build_off_main_thread(factory: Callable[[], T]) -> T:
    """Run `factory` (model loading) on a short-lived thread and return its result.

    The engine runs on its own thread. OpenMP (torch's and our kernels') keeps a worker pool per
    thread that ever opened a parallel region; if the main thread opened one while loading, its
    idle pool counts against the cores and libgomp stops spin-waiting (it throttles when it
    manages more threads than CPUs), which doubled the decode step on a 2-core machine (10.6 ->
    20 ms). Loading on a thread that then exits leaves the engine thread the only OpenMP owner.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = factory()
        except BaseException as e:   # re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="slipstream-load")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class EngineDrainingError(Exception):
    """The server is shutting down and takes no new requests."""


class EngineFailedError(Exception):
    """The engine thread failed while running a request (a bug, not the user's input)."""


@dataclass
class StreamEvent:
    """What one engine step produced for one request, snapshotted on the engine thread."""

    index: int                      # position of the request in its submission (the choice index)
    request_id: str
    text: str                       # new final text (stop strings already cut)
    token_ids: list[int]            # tokens added in this step
    logprobs: list[TokenLogprobs]   # one per token when the request asked for logprobs
    finish_reason: str | None       # set on the request's last event
    num_prompt_tokens: int
    num_output_tokens: int          # output tokens so far, these included
    request: Request = field(repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStream:
    """The events of one submission's requests, in the order the engine produced them.

    Iterate it until it stops (every request finished) or `close()` it: closing aborts the
    unfinished requests in the engine (their KV blocks are freed). Not thread-safe: use it on the
    event loop it was created on.
    """

    def __init__(self, owner: AsyncEngine, requests: list[Request]):
        self._owner = owner
        self.requests = requests
        self._queue: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()
        self._unfinished = {r.request_id for r in requests}
        self._released = False

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if not self._unfinished:
            self._release()
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled (the client went away): stop the requests
            self.close()
            raise
        if isinstance(item, BaseException):
            self._unfinished.clear()
            self._release()
            raise item
        if item.finish_reason is not None:
            self._unfinished.discard(item.request_id)
            if not self._unfinished:
                self._release()
        return item

    def close(self) -> None:
        """Abort whatever is unfinished; idempotent."""
        if self._unfinished:
            self._owner.abort(list(self._unfinished))
            self._unfinished.clear()
        self._release()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def _push(self, item: StreamEvent | BaseException) -> None:
        if self._unfinished:
            self._queue.put_nowait(item)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._owner._stream_done()


# -- the engine thread's inbox: typed messages -----------------------------------------------------

@dataclass(frozen=True)
class Submit:
    """Add a submission's requests to the engine (all or none); settle `future` when done."""

    stream: RequestStream
    future: asyncio.Future


@dataclass(frozen=True)
class Abort:
    """Drop requests (unknown or finished ids are ignored)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class CutAll:
    """End every running request now: each open stream gets `EngineDrainingError(reason)`."""

    reason: str


Message = Union[Submit, Abort, CutAll]


@dataclass
class _Live:
    """Engine-thread bookkeeping of one running request."""

    stream: RequestStream
    index: int
    request: Request
    num_output: int = 0
    last_token_time: float | None = None


class AsyncEngine:
    """Owns an `Engine` on a daemon thread; `submit`/`generate` from the event loop."""

    def __init__(self, engine: Any, metrics: Any = None, name: str = "slipstream-engine"):
        self.engine = engine
        self.metrics = metrics
        self._name = name
        self._cond = threading.Condition()
        self._inbox: list[Message] = []
        self._batch: list[Message] = []             # messages taken from the inbox, not yet done
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, _Live] = {}          # engine thread only
        self._stats: Any = None                     # the last EngineStats snapshot
        self._accepting = True
        self._inflight = 0                          # open streams (event loop only)
        self._idle: asyncio.Event | None = None
        self.failure: BaseException | None = None   # why the thread died, if it did

    # -- lifecycle (event loop) -------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        self._loop = loop or asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        try:
            self._stats = self.engine.stats()
        except Exception:  # stats are for metrics only
            log.exception("engine.stats() failed")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running

    @property
    def num_inflight(self) -> int:
        return self._inflight

    def stop_accepting(self) -> None:
        """New submissions fail with EngineDrainingError from now on; in-flight ones go on."""
        self._accepting = False

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop accepting and wait until every open stream is finished; False on timeout."""
        self.stop_accepting()
        if self._idle is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Drain, then stop the engine thread (aborting anything still running)."""
        await self.drain(drain_timeout)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    # -- requests (event loop) ------------------------------------------------------------------
    async def submit(self, items: Sequence[tuple[list[int], SamplingParams]], priority: int = 0,
                     request_id: str | None = None) -> RequestStream:
        """Add requests (one per (prompt_ids, params) item) to the engine as one unit.

        Returns once the engine thread has accepted all of them; what `engine.add_request` raises
        (a too-long prompt, a full queue, ...) is raised here, and none of the items is left running.
        """
        if not self._accepting:
            raise EngineDrainingError("the server is shutting down and takes no new requests")
        if not self.is_running:
            raise EngineFailedError("the engine is not running")
        if not items:
            raise ValueError("nothing to submit")
        rid = request_id or f"req-{uuid.uuid4().hex}"
        reqs = [Request(list(ids), params, request_id=rid if len(items) == 1 else f"{rid}-{i}", priority=priority)
                for i, (ids, params) in enumerate(items)]
        stream = RequestStream(self, reqs)
        self._inflight += 1
        assert self._idle is not None and self._loop is not None
        self._idle.clear()
        fut: asyncio.Future[None] = self._loop.create_future()
        self._post(Submit(stream, fut))
        try:
            await fut
        except asyncio.CancelledError:
            stream.close()
            raise
        except BaseException:
            stream._unfinished.clear()
            stream._release()
            raise
        return stream

    async def generate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                       request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """One request's events. Errors of validation raise at the first `__anext__`, before any
        event; leaving the loop early (or being cancelled) aborts the request."""
        stream = await self.submit([(prompt_ids, params)], priority, request_id)
        try:
            async for ev in stream:
                yield ev
        finally:
            stream.close()

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop requests (thread-safe); unknown or finished ids are ignored."""
        if request_ids:
            self._post(Abort(tuple(request_ids)))

    def cut_all(self, reason: str = "the server shut down before the request finished") -> None:
        """End every running request now (thread-safe): its stream gets an EngineDrainingError."""
        self._post(CutAll(reason))

    def stats(self) -> Any:
        """The engine's stats as of its last step (EngineStats), or None before the first."""
        return self._stats

    def _stream_done(self) -> None:
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()

    def _post(self, msg: Message) -> None:
        with self._cond:
            if not self._stop:
                self._inbox.append(msg)
                self._cond.notify()
                return
        if isinstance(msg, Submit):   # nobody reads the inbox any more: answer now instead of never
            self._call_soon(_settle, msg.future, EngineFailedError("the engine is not running"))

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:  # a bug: fail whatever is running, keep the process up
            log.exception("the engine thread failed")
            self.failure = e
            err = EngineFailedError("the engine failed (a bug; the server log has the details)")
            with self._cond:
                self._stop = True
                unread, self._inbox = self._batch + self._inbox, []
            self._fail_all(err)
            for msg in unread:   # submissions taken but not processed: their callers must hear of it
                if isinstance(msg, Submit):
                    self._call_soon(_settle, msg.future, err)

    def _loop_forever(self) -> None:
        engine = self.engine
        backoff = False
        while True:
            with self._cond:
                if backoff and not self._inbox:
                    self._cond.wait(_NOOP_BACKOFF_S)
                while not self._inbox and not self._stop and not engine.has_unfinished():
                    self._cond.wait()
                self._batch, self._inbox = self._inbox, []
                stop = self._stop
            deliveries: list[tuple[RequestStream, StreamEvent | BaseException]] = []
            while self._batch:
                msg = self._batch[0]
                if isinstance(msg, Submit):
                    self._add(msg.stream, msg.future)
                elif isinstance(msg, Abort):
                    self._abort(list(msg.request_ids))
                else:
                    deliveries += self._cut(msg.reason)
                self._batch.pop(0)
            if stop:   # whatever is still running is cut off (drain first to avoid that)
                deliveries += self._cut("the server shut down before the request finished")
                self._snapshot_stats()
                if deliveries:
                    self._deliver(deliveries)
                return
            backoff = False
            if engine.has_unfinished():
                t0 = time.perf_counter()
                try:
                    events = engine.step()
                except Exception:
                    log.exception("engine step failed")
                    err = EngineFailedError("the engine failed while generating (a bug; the server log has "
                                            "the details)")
                    for rid, live in list(self._live.items()):
                        deliveries.append((live.stream, err))
                        self._safe_abort(rid)
                    self._live.clear()
                    events = []
                backoff = not events and time.perf_counter() - t0 < _NOOP_STEP_S
                deliveries += self._collect(events)
            self._snapshot_stats()   # before delivery: a client that got its last token sees fresh stats
            if deliveries:
                self._deliver(deliveries)

    def _add(self, stream: RequestStream, fut: asyncio.Future) -> None:
        added: list[Request] = []
        try:
            for r in stream.requests:
                self.engine.add_request(r)
                added.append(r)
        except BaseException as e:
            for r in added:
                self._safe_abort(r.request_id)
            self._call_soon(_settle, fut, e)
            return
        for i, r in enumerate(stream.requests):
            self._live[r.request_id] = _Live(stream, i, r)
            if self.metrics is not None:
                self.metrics.on_admitted(len(r.prompt_ids))
        self._call_soon(_settle, fut, None)

    def _cut(self, reason: str) -> list[tuple[RequestStream, StreamEvent | BaseException]]:
        err = EngineDrainingError(reason)
        cut: list[tuple[RequestStream, StreamEvent | BaseException]] = [
            (live.stream, err) for live in self._live.values()]
        self._abort(list(self._live))
        return cut

    def _abort(self, request_ids: list[str]) -> None:
        now = time.perf_counter()
        for rid in request_ids:
            live = self._live.pop(rid, None)
            if live is None:
                continue
            self._safe_abort(rid)
            if self.metrics is not None:
                r = live.request
                self.metrics.on_finished("abort", len(r.prompt_ids), live.num_output,
                                         now - r.metrics.arrival, None, None)

    def _safe_abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("engine.abort(%s) failed", rid)

    def _collect(self, events: list) -> list[tuple[RequestStream, StreamEvent | BaseException]]:
        out: list[tuple[RequestStream, StreamEvent | BaseException]] = []
        if not events:
            return out
        now = time.perf_counter()
        last = {ev.request.request_id: i for i, ev in enumerate(events)}   # where a finish may show
        m = self.metrics
        for i, ev in enumerate(events):
            r = ev.request
            rid = r.request_id
            live = self._live.get(rid)
            if live is None:   # aborted meanwhile
                continue
            n = len(ev.token_ids)
            rm = r.metrics
            if n:
                first = live.num_output == 0
                if first:
                    t_first = rm.first_token if rm.first_token is not None else now
                    if m is not None:
                        m.on_tokens(n, True, t_first - rm.arrival, None)
                else:
                    if m is not None:
                        m.on_tokens(n, False, None, now - (live.last_token_time or now))
                live.last_token_time = now
                live.num_output += n
            finish = r.finish_reason if last[rid] == i else None
            out.append((live.stream, StreamEvent(
                live.index, rid, ev.text, list(ev.token_ids), list(getattr(ev, "logprobs", None) or []),
                finish, len(r.prompt_ids), live.num_output, r)))
            if finish is not None:
                del self._live[rid]
                if m is not None:
                    end = rm.finished if rm.finished is not None else now
                    scheduled = getattr(rm, "scheduled", None)
                    m.on_finished(finish, len(r.prompt_ids), live.num_output, end - rm.arrival,
                                  None if scheduled is None else scheduled - rm.arrival,
                                  None if rm.first_token is None else rm.first_token - rm.arrival)
        return out

    def _snapshot_stats(self) -> None:
        try:
            self._stats = self.engine.stats()
        except Exception:
            log.exception("engine.stats() failed")

    def _fail_all(self, err: BaseException) -> None:
        deliveries: list[tuple[RequestStream, StreamEvent | BaseException]] = [
            (live.stream, err) for live in self._live.values()]
        for rid in list(self._live):
            self._safe_abort(rid)
        self._live.clear()
        if deliveries:
            self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple[RequestStream, StreamEvent | BaseException]]) -> None:
        self._call_soon(_push_all, deliveries)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():   # the submitter was cancelled
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _push_all(deliveries: list[tuple[RequestStream, StreamEvent | BaseException]]) -> None:
    seen_errors: set[int] = set()
    for stream, item in deliveries:
        if isinstance(item, BaseException):   # one error per stream is enough
            if id(stream) in seen_errors:
                continue
            seen_errors.add(id(stream))
        stream._push(item)
