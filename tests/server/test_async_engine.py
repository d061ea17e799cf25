"""AsyncEngine (the engine on its own thread) against a scripted fake engine: no model, fast.

Checks what the HTTP layer relies on: events arrive in order with the finish snapshotted,
add_request's errors raise before any event, a consumer that leaves aborts its requests, an idle
engine thread does not spin, a failing step fails its requests but not the thread, drain/shutdown.
"""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("prometheus_client")

from fake_engine import FakeEngine  # noqa: E402

from slipstream.engine.sampling import SamplingParams  # noqa: E402
from slipstream.errors import PromptTooLongError, QueueFullError  # noqa: E402
from slipstream.server.async_engine import AsyncEngine, EngineDrainingError, EngineFailedError  # noqa: E402
from slipstream.server.metrics import ServerMetrics, parse_metrics  # noqa: E402

pytestmark = pytest.mark.asyncio


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


async def _started(fake: FakeEngine) -> tuple[AsyncEngine, ServerMetrics]:
    holder: dict = {}
    metrics = ServerMetrics(stats=lambda: holder["ae"].stats())
    ae = AsyncEngine(fake, metrics=metrics)
    holder["ae"] = ae
    ae.start()
    return ae, metrics


async def _wait_for(cond, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        await asyncio.sleep(0.005)


async def test_events_in_order_with_final_snapshot():
    fake = FakeEngine()
    ae, metrics = await _started(fake)
    try:
        events = [ev async for ev in ae.generate([1, 2, 3], _params(5))]
        assert "".join(e.text for e in events) == "t1 t2 t3 t4 t5 "
        assert [e.finish_reason for e in events] == [None] * 4 + ["length"]
        assert [e.num_output_tokens for e in events] == [1, 2, 3, 4, 5]
        assert all(e.num_prompt_tokens == 3 for e in events)
        assert fake.thread_ids == {ae._thread.ident}, "the engine must only be touched by its own thread"
        m = parse_metrics(metrics.render().decode())
        assert m["slipstream_generation_tokens_total"] == 5.0
        assert m["slipstream_prompt_tokens_total"] == 3.0
        assert m['slipstream_request_success_total{finished_reason="length"}'] == 1.0
        assert m["slipstream_time_to_first_token_seconds_count"] == 1.0
        assert m["slipstream_inter_token_latency_seconds_count"] == 4.0
        assert m["slipstream_e2e_request_latency_seconds_count"] == 1.0
        assert m["slipstream_request_queue_time_seconds_count"] == 1.0
        assert m["slipstream_kv_blocks_total"] == 64.0
        assert m["slipstream_kv_blocks_in_use"] == 0.0
    finally:
        await ae.shutdown()


async def test_several_requests_in_one_submission():
    fake = FakeEngine()
    ae, _ = await _started(fake)
    try:
        stream = await ae.submit([([1], _params(2)), ([1, 2], _params(4)), ([3], _params(3))])
        texts: dict[int, str] = {0: "", 1: "", 2: ""}
        finishes = {}
        async for ev in stream:
            texts[ev.index] += ev.text
            if ev.finished:
                finishes[ev.index] = ev.finish_reason
        assert texts == {0: "t1 t2 ", 1: "t1 t2 t3 t4 ", 2: "t1 t2 t3 "}
        assert finishes == {0: "length", 1: "length", 2: "length"}
        assert stream.finished and ae.num_inflight == 0
    finally:
        await ae.shutdown()


async def test_add_request_errors_raise_before_streaming():
    fake = FakeEngine(max_waiting=1)
    ae, _ = await _started(fake)
    try:
        with pytest.raises(PromptTooLongError, match="11 tokens"):
            await ae.submit([([1] * 11, _params(2))])
        gen = ae.generate([1] * 11, _params(2))
        with pytest.raises(PromptTooLongError):
            await gen.__anext__()
        # the second of two fails: the first must not stay behind in the engine
        with pytest.raises(QueueFullError):
            await ae.submit([([1], _params(50)), ([2], _params(50))])
        await _wait_for(lambda: not fake.requests)
        assert len(fake.aborted) == 1
        assert ae.num_inflight == 0
    finally:
        await ae.shutdown()


async def test_consumer_leaving_aborts_the_request():
    fake = FakeEngine()
    ae, metrics = await _started(fake)
    try:
        gen = ae.generate([1], _params(10_000), request_id="leaver")
        async for ev in gen:
            if ev.num_output_tokens >= 3:
                break
        await gen.aclose()
        await _wait_for(lambda: "leaver" in fake.aborted)
        assert not fake.requests

        # cancellation (a client disconnect) while waiting for the next event
        async def consume() -> None:
            async for _ in ae.generate([1], _params(10_000), request_id="cancelled"):
                pass
        task = asyncio.ensure_future(consume())
        await _wait_for(lambda: "cancelled" in fake.requests and len(fake.requests["cancelled"].output_ids) > 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_for(lambda: "cancelled" in fake.aborted)
        assert ae.num_inflight == 0
        m = parse_metrics(metrics.render().decode())
        assert m['slipstream_request_success_total{finished_reason="abort"}'] == 2.0
    finally:
        await ae.shutdown()


async def test_idle_engine_thread_sleeps():
    fake = FakeEngine()
    ae, _ = await _started(fake)
    try:
        _ = [ev async for ev in ae.generate([1], _params(3))]
        steps = fake.steps
        cpu0 = time.process_time()
        await asyncio.sleep(0.3)
        assert fake.steps == steps, "no steps while idle"
        assert time.process_time() - cpu0 < 0.1, "an idle server must not burn CPU"
        # and it wakes up for new work
        assert len([ev async for ev in ae.generate([1], _params(2))]) == 2
    finally:
        await ae.shutdown()


async def test_failed_step_fails_its_requests_not_the_thread():
    fake = FakeEngine(fail_at_step=2)
    ae, _ = await _started(fake)
    try:
        with pytest.raises(EngineFailedError, match="engine failed") as e:
            async for _ in ae.generate([1], _params(5)):
                pass
        assert "boom" not in str(e.value), "internal exception text must not reach a client"
        assert ae.is_running
        assert [ev.text async for ev in ae.generate([1], _params(2))] == ["t1 ", "t2 "]
    finally:
        await ae.shutdown()


async def test_drain_lets_inflight_finish_and_refuses_new():
    fake = FakeEngine(step_s=0.01)
    ae, _ = await _started(fake)
    stream = await ae.submit([([1], _params(20))])
    got: list[str] = []

    async def consume() -> None:
        async for ev in stream:
            got.append(ev.text)
    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.02)
    shutdown = asyncio.ensure_future(ae.shutdown())
    await asyncio.sleep(0.01)
    with pytest.raises(EngineDrainingError):
        await ae.submit([([1], _params(2))])
    await asyncio.wait_for(shutdown, 10)
    await task
    assert len(got) == 20, "the in-flight request must run to its end"
    assert not ae.is_running


async def test_cut_all_ends_running_streams_and_keeps_the_thread():
    fake = FakeEngine(step_s=0.01)
    ae, _ = await _started(fake)
    try:
        stream = await ae.submit([([1], _params(1000)), ([1], _params(1000))])
        got = []
        with pytest.raises(EngineDrainingError, match="cut for the test"):
            async for ev in stream:
                got.append(ev)
                if len(got) == 3:
                    ae.cut_all("cut for the test")
        assert not fake.requests, "the cut requests were aborted in the engine"
        assert ae.is_running and ae.num_inflight == 0
        assert len([ev async for ev in ae.generate([1], _params(2))]) == 2
    finally:
        await ae.shutdown()
