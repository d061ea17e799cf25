"""The endpoint in front of the replicas, over scripted replicas (no Ray): retries before an answer
starts, a clean SSE error event and [DONE] when a replica dies mid-stream, 503 when no replica is
left, /health and the aggregated /metrics."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import pytest

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.asyncio

from slipstream.distributed.asgi_call import ForwardedRequest  # noqa: E402
from slipstream.distributed.ingress import Ingress, ReplicaFailed  # noqa: E402
from slipstream.distributed.router import Router  # noqa: E402
from slipstream.server.metrics import parse_metrics  # noqa: E402

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


class ScriptedReplica:
    """ok: answers a two-chunk stream; fail-before: dies before answering; fail-mid: after one chunk."""

    def __init__(self, index: int, mode: str):
        self.index, self.mode, self.calls = index, mode, 0

    async def stream(self, request: ForwardedRequest) -> AsyncIterator[dict[str, Any] | bytes]:
        self.calls += 1
        if self.mode == "fail-before":
            raise ReplicaFailed("ActorDiedError: the actor died")
        yield {"status": 200, "headers": [[b"content-type", b"text/event-stream"], [b"x-request-id", b"inner"]]}
        yield CHUNK
        if self.mode == "fail-mid":
            raise ReplicaFailed("ActorDiedError: the actor died")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        yield b"data: [DONE]\n\n"

    async def info(self) -> dict[str, Any]:
        return {"ready": True, "generation": f"g{self.index}", "pid": 1000 + self.index, "node": "here"}

    async def metrics(self) -> str:
        return ("# HELP slipstream_prefix_cache_hits Prompt tokens found in the prefix cache.\n"
                "# TYPE slipstream_prefix_cache_hits counter\n"
                f"slipstream_prefix_cache_hits_total {10.0 * (self.index + 1)}\n"
                "# HELP slipstream_kv_cache_usage_perc Fraction of KV-cache blocks in use.\n"
                "# TYPE slipstream_kv_cache_usage_perc gauge\n"
                f"slipstream_kv_cache_usage_perc {0.2 * (self.index + 1)}\n")


async def _ingress(*modes: str) -> tuple[Ingress, list[ScriptedReplica]]:
    reps = [ScriptedReplica(i, m) for i, m in enumerate(modes)]
    ing = Ingress(list(reps), Router(len(reps), "round-robin"), key_of=lambda path, body: None)
    await ing.poll_once()
    return ing, reps


async def _post(ing: Ingress) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ing), base_url="http://test") as c:
        return await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "stream": True})


async def test_a_replica_that_fails_before_answering_is_retried_on_another():
    ing, reps = await _ingress("fail-before", "ok")
    r = await _post(ing)
    assert r.status_code == 200 and r.content == CHUNK + b"data: [DONE]\n\n"
    assert [p.calls for p in reps] == [1, 1]
    assert r.headers.get("x-request-id") is None          # the replica's own id is not passed on
    status, health = ing.health()
    assert status == 200 and health["replicas_ready"] == 1 and health["replicas_total"] == 2
    assert health["replicas"][0]["ready"] is False and "ActorDiedError" in health["replicas"][0]["error"]


async def test_a_replica_that_dies_mid_stream_ends_it_with_an_error_event_and_done():
    ing, _ = await _ingress("fail-mid")
    r = await _post(ing)
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == CHUNK
    err = json.loads(events[1].removeprefix(b"data: "))
    assert err["error"]["code"] == "replica_failed" and err["error"]["type"] == "server_error"
    assert events[2] == b"data: [DONE]" and len(events) == 3


async def test_no_replica_left_is_a_503_with_retry_after():
    ing, reps = await _ingress("fail-before", "fail-before")
    r = await _post(ing)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "replica_unavailable"
    assert [p.calls for p in reps] == [1, 1]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ing), base_url="http://test") as c:
        h = await c.get("/health")
    assert h.status_code == 503 and h.json()["replicas_ready"] == 0


async def test_metrics_per_replica_and_summed():
    ing, _ = await _ingress("ok", "ok")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ing), base_url="http://test") as c:
        await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
        m = parse_metrics((await c.get("/metrics")).text)
    assert m["slipstream_prefix_cache_hits_total"] == 30.0
    assert m['slipstream_prefix_cache_hits_total{replica="0"}'] == 10.0
    assert m['slipstream_prefix_cache_hits_total{replica="1"}'] == 20.0
    assert m["slipstream_kv_cache_usage_perc"] == pytest.approx(0.3)   # fractions are averaged
    assert m["slipstream_replicas_ready"] == 2.0 and m["slipstream_replicas_total"] == 2.0
    assert sum(v for k, v in m.items() if k.startswith("slipstream_router_requests_total{")) == 1.0


async def test_cut_all_ends_running_streams_with_an_error_event_and_done():
    """What the drain timeout does to streams still running."""
    ing, _ = await _ingress("hang")
    post = asyncio.ensure_future(_post(ing))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if ing.inflight:
            break
    await asyncio.sleep(0.05)
    ing.cut_all()
    r = await asyncio.wait_for(post, 10)
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == CHUNK
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "server_shutting_down"
    assert events[2] == b"data: [DONE]"
    assert ing.inflight == 0 and ing.router.replicas[0].inflight == 0
