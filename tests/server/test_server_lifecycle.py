"""Servers of their own: API keys, a full queue, and a SIGTERM that drains in-flight streams."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest
from server_support import REQUEST_TIMEOUT, ServerProcess

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def small_server(tmp_path_factory) -> ServerProcess:
    """An API key, one batch slot and one waiting slot (so a third request finds the queue full)."""
    from support import skip_unless_default_model

    skip_unless_default_model()
    pytest.importorskip("fastapi")
    srv = ServerProcess("--max-model-len", "1024", "--max-batch", "1", "--max-waiting", "1",
                        "--served-model-name", "tiny", log_path=tmp_path_factory.mktemp("small") / "serve.log",
                        env={"SLIPSTREAM_API_KEY": "sekrit"})
    yield srv
    srv.terminate()
    srv.kill()


def test_api_key(small_server):
    url = small_server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize")):
            r = httpx.request(method, url + path, headers=headers, json={}, timeout=30)
            assert r.status_code == 401, (headers, path, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    # health and metrics stay open, as in vLLM
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/metrics", timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    c = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0, timeout=REQUEST_TIMEOUT)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.model == "tiny" and r.usage.completion_tokens <= 3
    # the underlying model's own name is accepted too
    r = c.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens <= 2


def test_queue_full_is_503(small_server):
    url = small_server.base_url
    auth = {"Authorization": "Bearer sekrit"}
    long = {"prompt": "Once upon a time", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.Client(headers=auth, timeout=REQUEST_TIMEOUT) as h:
        with h.stream("POST", url + "/v1/completions", json=long) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data: "))         # it is running
            with h.stream("POST", url + "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200                               # accepted, queued
                r = h.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == "queue_full"
                assert r.headers["retry-after"] == "1"
        # more choices than the queue can ever hold: 400 with the numbers, not "retry later"
        r = h.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "too_many_choices", r.text
        assert "2" in err["message"] and "1" in err["message"]
        # both streams closed: aborted, so the server takes requests again (once it has seen them go)
        for _ in range(100):
            r = h.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            if r.status_code != 503:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text


def test_sigterm_drains_inflight_stream(start_server):
    srv = start_server("--max-model-len", "1024")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 40,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    events: list[str] = []
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    break
        srv.proc.send_signal(signal.SIGTERM)
        # while draining the listener stays open: /health says 503 and new work gets 503 + Retry-After
        draining: list[httpx.Response] = []

        def probe() -> None:
            for _ in range(100):
                try:
                    h = httpx.get(srv.base_url + "/health", timeout=2)
                except httpx.HTTPError:
                    return
                if h.status_code == 503:
                    draining.append(h)
                    draining.append(httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hi"}, timeout=10))
                    return
                threading.Event().wait(0.05)
        t = threading.Thread(target=probe)
        t.start()
        events += [line[6:] for line in lines if line.startswith("data: ")]
        t.join()
    assert events[-1] == "[DONE]", events[-3:]
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 40, "the stream was cut short by the shutdown"
    finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
    assert finishes[-1] == "length"
    assert srv.proc.wait(60) == 0, srv.log()
    assert len(draining) == 2, "the draining server answered /health and a new request"
    assert draining[0].json()["error"]["code"] == "server_shutting_down" and "retry-after" in draining[0].headers
    assert draining[1].status_code == 503 and draining[1].json()["error"]["code"] == "server_shutting_down"
    assert "retry-after" in draining[1].headers
    assert "Traceback" not in srv.log()


def test_drain_timeout_ends_every_stream_with_an_error_event_and_done(start_server):
    srv = start_server("--max-model-len", "2048", "--drain-timeout", "1")
    streams = 4

    def run(i: int, out: list) -> None:
        body = {"prompt": f"Story number {i}:", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])

    outs: list[list[str]] = [[] for _ in range(streams)]
    threads = [threading.Thread(target=run, args=(i, outs[i])) for i in range(streams)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while not all(len(o) >= 2 for o in outs):
        assert time.monotonic() - t0 < 120, "the streams did not start"
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert srv.proc.wait(60) == 0, srv.log()
    for o in outs:
        assert o[-1] == "[DONE]", o[-3:]
        err = json.loads(o[-2])["error"]
        assert err["code"] == "server_shutting_down" and err["type"] == "server_error", err
    assert "Traceback" not in srv.log()


def test_kv_cache_smaller_than_the_context_is_advertised_and_enforced(start_server):
    srv = start_server("--max-model-len", "1024", "--kv-cache-tokens", "256")
    card = httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == 256
    r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 300}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "256" in err["message"] and "1024" in err["message"] and "300" in err["message"], err
    r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
