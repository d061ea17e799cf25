"""Heavy traffic against the live server (the default model): a huge body while another client
streams, and a soak of 200 streams of which 30% walk away mid-stream."""
from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import httpx
from server_support import REQUEST_TIMEOUT, metrics

TEN_MB = 10 * 1024 * 1024


def _stream_times(base: str, out: list[float], stop: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.perf_counter())
                if stop.is_set():
                    return


def _declared_but_not_sent(port: int, path: str) -> tuple[bytes, float]:
    """Headers declaring a 10 MB body and only its first 64 KB: the answer must not wait for the rest."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {TEN_MB}\r\n\r\n".encode() + b'{"prompt": "' + b"a" * 65536)
        out = s.recv(65536)
    return out, time.perf_counter() - t0


def test_10mb_body_is_413_fast_while_another_stream_flows(server):
    port = int(server.rsplit(":", 1)[1])
    times: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=_stream_times, args=(server, times, stop))
    t.start()
    try:
        t0 = time.monotonic()
        while len(times) < 5:
            assert time.monotonic() - t0 < 60 and t.is_alive(), "the stream did not start"
            time.sleep(0.02)
        window_start = time.perf_counter()
        big = json.dumps({"messages": [{"role": "user", "content": "x" * TEN_MB}]}).encode()
        for path in ("/v1/chat/completions", "/tokenize", "/v1/completions"):
            t1 = time.perf_counter()
            r = httpx.post(server + path, content=big, headers={"content-type": "application/json"}, timeout=30)
            took = time.perf_counter() - t1
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
            assert took < 1.0, f"{path}: 413 after {took:.2f} s"
            out, took = _declared_but_not_sent(port, path)
            assert out.startswith(b"HTTP/1.1 413") and took < 1.0, (out[:100], took)
        window_end = time.perf_counter()
        while len(times) < 5 or times[-1] < window_end:   # the first token after the window closes the gap
            assert t.is_alive(), "the stream ended"
            time.sleep(0.02)
    finally:
        stop.set()
        t.join(60)
    gaps = [b - a for a, b in zip(times, times[1:]) if b > window_start and a < window_end]
    assert gaps and max(gaps) < 1.0, f"inter-token gaps while the big bodies came: {sorted(gaps)[-3:]}"
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_soak_200_streams_with_30_percent_disconnects(server):
    before = metrics(server)
    rng = random.Random(19)
    leave = set(rng.sample(range(200), 60))      # 30% leave after their first chunk

    async def one(c: httpx.AsyncClient, sem: asyncio.Semaphore, i: int) -> str:
        body = {"prompt": f"Note {i}: the weather", "max_tokens": 3, "stream": True, "ignore_eos": True,
                "temperature": 0.8, "seed": i, "stream_options": {"include_usage": True}}
        async with sem:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if i in leave:
                            return "left"
        assert events[-1] == "[DONE]", events[-3:]
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 3, usage
        return "done"

    async def main() -> list[str]:
        sem = asyncio.Semaphore(32)
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server, timeout=REQUEST_TIMEOUT, limits=limits) as c:
            return await asyncio.gather(*(one(c, sem, i) for i in range(200)))

    results = asyncio.run(main())
    assert results.count("done") == 140 and results.count("left") == 60, "no stream may be lost"
    t0 = time.monotonic()
    while True:
        m = metrics(server)
        if m["slipstream_num_requests_running"] == 0 and m["slipstream_num_requests_waiting"] == 0:
            break
        assert time.monotonic() - t0 < 60, "the server did not go idle"
        time.sleep(0.1)
    assert m["slipstream_kv_blocks_in_use"] == 0, "leaked KV blocks"
    done = 'slipstream_request_success_total{finished_reason="length"}'
    assert m[done] - before.get(done, 0.0) >= 140
    assert httpx.get(server + "/health", timeout=10).status_code == 200
