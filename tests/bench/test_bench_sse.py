"""SSE parsing, and the client path over a mocked transport with a fake clock (exact timestamps)."""
from __future__ import annotations

import asyncio
import json

import httpx

from slipstream.bench.client import Prompt, SSEDecoder, Target, build_payload, send_request
from slipstream.bench.metrics import request_metrics


def feed_all(parts):
    d = SSEDecoder()
    out = []
    for p in parts:
        out += d.feed(p)
    out += d.close()
    return out


def test_sse_basic_and_fields():
    evs = feed_all([b'data: {"a": 1}\n\n', b": keep-alive comment\n\n", b"event: error\ndata: x\nid: 7\n\n",
                    b"data: [DONE]\n\n"])
    assert [(e.event, e.data) for e in evs] == [("message", '{"a": 1}'), ("error", "x"), ("message", "[DONE]")]
    assert evs[1].id == "7"


def test_sse_any_split_gives_the_same_events():
    raw = ('data: {"x": "é€😀"}\r\n\r\ndata: line1\ndata: line2\n\n'
           'data:nospace\r\rdata:  two spaces\n\ndata: [DONE]\n\n').encode()
    want = [e.data for e in feed_all([raw])]
    assert want == ['{"x": "é€😀"}', "line1\nline2", "nospace", " two spaces", "[DONE]"]
    for step in (1, 2, 3, 5, 7):      # splits inside CRLF pairs and inside UTF-8 sequences
        parts = [raw[i:i + step] for i in range(0, len(raw), step)]
        assert [e.data for e in feed_all(parts)] == want


def test_sse_unterminated_last_event_is_flushed_on_close():
    d = SSEDecoder()
    assert d.feed(b"data: a\n\ndata: b") [0].data == "a"
    assert [e.data for e in d.close()] == ["b"]


def test_sse_lone_cr_at_end_of_read_waits_for_next():
    d = SSEDecoder()
    assert d.feed(b"data: a\r") == []
    assert [e.data for e in d.feed(b"\n\r\n")] == ["a"]


def test_payload_fields():
    t = Target("http://h:1/v1/", model="m", endpoint="chat")
    assert t.base_url == "http://h:1" and t.url == "http://h:1/v1/chat/completions"
    p = Prompt([{"role": "user", "content": "hi"}], 7, fixed_length=True)
    body = build_payload(t, p, temperature=0.0)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == 7 and body["max_tokens"] == 7
    assert "ignore_eos" not in build_payload(t, p, temperature=0.0, fixed_fields=())
    c = build_payload(Target("http://h:1", endpoint="completions"), p, temperature=0.0)
    assert c["prompt"] == "hi" and "messages" not in c


def _chunk(content=None, finish=None, usage=None):
    obj = {"choices": [{"index": 0, "delta": {} if content is None else {"content": content}, "finish_reason": finish}]}
    if usage is not None:
        obj = {"choices": [], "usage": usage}
    return ("data: " + json.dumps(obj) + "\n\n").encode()


class FakeClock:
    def __init__(self, values):
        self.values = list(values)

    def __call__(self):
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


def run_mock(reads, clock_values, status=200, endpoint="chat"):
    async def stream():
        for r in reads:
            yield r

    def handler(request):
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "nope"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=httpx_stream(stream()))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await send_request(c, Target("http://fake", endpoint=endpoint), Prompt([{"role": "user", "content": "x"}], 5),
                                      clock=FakeClock(clock_values))
    return asyncio.run(go())


class httpx_stream(httpx.AsyncByteStream):
    def __init__(self, gen):
        self.gen = gen

    async def __aiter__(self):
        async for x in self.gen:
            yield x


def test_client_timeline_from_reads():
    # reads: role chunk (no content) at 0.125; two content chunks in one read at 0.25 (2 tokens);
    # one at 0.5; finish + usage + [DONE] at 0.75. Usage says 4 tokens (one chunk carried two).
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
    reads = [role, _chunk("Hel") + _chunk("lo"), _chunk(" world"),
             _chunk(None, "length") + _chunk(usage={"prompt_tokens": 9, "completion_tokens": 4}) + b"data: [DONE]\n\n"]
    r = run_mock(reads, [0.0, 0.125, 0.25, 0.5, 0.75, 0.875, 1.0])
    assert r.ok and r.error is None
    assert r.text == "Hello world"
    assert r.chunk_times == [0.25, 0.25, 0.5]
    assert r.finish_reason == "length"
    assert (r.prompt_tokens, r.output_tokens, r.output_tokens_source) == (9, 4, "usage")
    m = request_metrics(r)
    assert m.ttft == 0.25 and m.e2e == 0.5 and m.itl == [0.0, 0.25]
    assert m.tpot == (0.5 - 0.25) / 3


def test_client_failures_are_results_not_exceptions():
    r = run_mock([], [0.0], status=500)
    assert not r.ok and r.error.startswith("HTTP 500") and "nope" in r.error
    r = run_mock([_chunk("a"), b'data: {"error": {"message": "kaput"}}\n\n'], [0.0, 0.1, 0.2])
    assert not r.ok and "kaput" in r.error
    r = run_mock([b"data: [DONE]\n\n"], [0.0, 0.1])
    assert not r.ok and "without content" in r.error
    r = run_mock([b"data: {not json\n\n"], [0.0, 0.1])
    assert not r.ok and "bad JSON" in r.error


def test_client_completions_endpoint_text_field():
    reads = [b'data: {"choices": [{"index": 0, "text": "ab", "finish_reason": null}]}\n\n',
             b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n']
    r = run_mock(reads, [0.0, 0.5, 0.75, 1.0], endpoint="completions")
    assert r.ok and r.text == "ab" and r.chunk_times == [0.5] and r.finish_reason == "stop"
    assert r.output_tokens is None      # no usage: filled in later, never counted from chunks here
