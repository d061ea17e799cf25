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
        # the listening socket closes: new connections are refused while the stream goes on
        refused = threading.Event()

        def probe() -> None:
            for _ in range(100):
                try:
                    httpx.get(srv.base_url + "/health", timeout=2)
                except httpx.ConnectError:
                    refused.set()
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
    assert refused.is_set()
    assert "Traceback" not in srv.log()
