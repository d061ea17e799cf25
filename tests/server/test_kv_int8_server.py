"""`slipstream serve --kv-cache-dtype int8` driven the way a user would: the real `openai` client against a real
server on 127.0.0.1. Streams and plain requests over the 8-bit cache (a long prompt prefilled by the eager step,
short ones on the native step, concurrently), the same greedy answer twice (the second from the prefix cache),
a client that leaves mid-stream, every KV block back once the server is idle, and the startup line naming
the cache's element type."""
from __future__ import annotations

import threading
import time

import httpx
import openai
from server_support import REQUEST_TIMEOUT, metrics

MODEL = "smollm2-135m"


def test_int8_cache_serves_streams_and_frees_its_blocks(start_server):
    srv = start_server("--max-model-len", "1024", "--kv-cache-dtype", "int8")
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)
    long_question = "The history of the river valley is long and varied. " * 12 + "Summarize it."
    extra = {"ignore_eos": True}
    answers: dict[str, str] = {}

    def chat(name: str, content: str, n: int) -> None:
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                max_tokens=n, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body=extra)
        text, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == n, usage
        answers[name] = "".join(text)

    threads = [threading.Thread(target=chat, args=("long", long_question, 24)),
               threading.Thread(target=chat, args=("short", "Name three colours.", 16))]
    for t in threads:
        t.start()
    # a client that leaves after its first tokens
    with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=REQUEST_TIMEOUT,
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT)
    assert set(answers) == {"long", "short"} and all(answers.values()), answers

    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_question}],
                                           max_tokens=24, temperature=0, extra_body=extra)
    assert again.choices[0].message.content == answers["long"]   # the cached prefix decodes the same tokens

    t0 = time.monotonic()
    while True:
        m = metrics(srv.base_url)
        if m["slipstream_num_requests_running"] == 0 and m["slipstream_num_requests_waiting"] == 0:
            break
        assert time.monotonic() - t0 < 60, "the server did not go idle"
        time.sleep(0.1)
    assert m["slipstream_kv_blocks_in_use"] == 0, "leaked KV blocks"
    assert "Traceback" not in srv.log()
    assert "int8" in next(line for line in srv.log().splitlines() if "loaded in" in line)   # the startup line says so
