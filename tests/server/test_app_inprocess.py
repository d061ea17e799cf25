"""The app in-process over a fake engine (no model, no sockets): the paths a live server cannot be
pushed into on demand, i.e. a tokenizer bug (500, still OpenAI-shaped), the engine's own rejections,
a full queue, draining, and an engine failure in the middle of a stream."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
from fake_engine import FakeEngine, FakeLLM  # noqa: E402

from slipstream.server.app import build_app  # noqa: E402

pytestmark = pytest.mark.asyncio
MSGS = [{"role": "user", "content": "hi"}]


class InProcess:
    def __init__(self, engine: FakeEngine | None = None, **kw):
        self.llm = FakeLLM(engine)
        self.app = build_app(self.llm, **kw)
        self.engine = self.app.state.server.engine

    async def __aenter__(self) -> httpx.AsyncClient:
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30)
        return self.client

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        await self._lifespan.__aexit__(None, None, None)


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


def _sse(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]


async def test_chat_and_stream_over_fake_engine():
    async with InProcess() as c:
        r = await c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3, "n": 2})
        body = r.json()
        assert [ch["message"]["content"] for ch in body["choices"]] == ["t1 t2 t3 "] * 2
        # "user: hi\nassistant:" is 3 words = 3 prompt tokens; 2 choices x 3 tokens
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
        r = await c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, "stream": True, "n": 2,
                                                 "logprobs": 1, "stream_options": {"include_usage": True}})
        events = _sse(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        texts = {0: "", 1: ""}
        for ch in chunks[:-1]:
            (choice,) = ch["choices"]
            texts[choice["index"]] += choice["text"]
            assert choice["logprobs"]["tokens"] == [choice["text"]]
        assert texts == {0: "t1 t2 ", 1: "t1 t2 "}


async def test_unexpected_exception_is_a_json_500():
    async with InProcess() as c:
        r = await c.post("/v1/completions", json={"prompt": "please explode", "max_tokens": 2})
        err = _error(r, 500)
        assert err["type"] == "server_error"
        # and the server goes on
        assert (await c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})).status_code == 200


async def test_engine_rejections_are_4xx_and_503():
    fake = FakeEngine()
    async with InProcess(fake) as c:
        err = _error(await c.post("/v1/completions", json={"prompt": "a " * 12, "max_tokens": 2}), 400,
                     "context_length_exceeded")
        assert "12 tokens" in err["message"] and err["param"] == "prompt"
        fake.max_waiting = 0
        err = _error(await c.post("/v1/chat/completions", json={"messages": MSGS}), 503, "queue_full")
        assert err["type"] == "server_error"


async def test_draining_refuses_new_requests():
    proc = InProcess()
    async with proc as c:
        proc.engine.stop_accepting()
        _error(await c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}), 503,
               "server_shutting_down")
        assert (await c.get("/health")).status_code == 503


async def test_engine_failure_mid_stream():
    async with InProcess(FakeEngine(fail_at_step=3)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 10, "stream": True})
        assert r.status_code == 200
        events = _sse(r.text)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "server_error"
    # not streaming: a 500, OpenAI-shaped
    async with InProcess(FakeEngine(fail_at_step=1)) as c:
        _error(await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}), 500)
