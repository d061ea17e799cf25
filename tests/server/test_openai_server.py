"""`slipstream serve` driven by the real `openai` client (sync and async) and raw HTTP, as users do.

One server (the default model, default settings) is shared by the session (see conftest.py).
Greedy output is compared with the Python API on the same prompts; usage must equal the token
counts; bad input must get a 4xx with OpenAI's error shape, never a 500.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_support import REQUEST_TIMEOUT, metrics

from slipstream import LLM, SamplingParams

MODEL = "smollm2-135m"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def ref_llm(server) -> LLM:
    """The same model in this process, to compare the server's greedy output with."""
    return LLM(max_model_len=2048, exact=True)   # the session server runs --exact too


def _greedy_chat(llm: LLM, messages: list[dict], max_tokens: int, **kw):
    return llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0, **kw))[0]


def _sse_events(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def _assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# -- basics ---------------------------------------------------------------------------------------

def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = httpx.get(f"{server}/v1/models", timeout=10).json()["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == 8192
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_chat_matches_engine(client, ref_llm):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours of the rainbow."}]
    want = _greedy_chat(ref_llm, messages, 16)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.model == MODEL
    assert len(got.choices) == 1
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_completion_matches_engine(client, ref_llm):
    prompt = "The three largest cities in Japan are"
    want = ref_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got.object == "text_completion"
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    # the same prompt as token ids, and as a list of one string
    ids = ref_llm.tokenizer.encode(prompt)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == want.text and by_ids.usage.prompt_tokens == len(ids)
    by_list = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=12, temperature=0)
    assert by_list.choices[0].text == want.text


def test_multi_turn_with_the_response_message(client, ref_llm):
    history = [{"role": "user", "content": "My name is Ada."}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    history += [first.choices[0].message, {"role": "user", "content": "What is my name?"}]   # as clients do
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    as_dicts = [history[0], {"role": "assistant", "content": first.choices[0].message.content}, history[2]]
    want = _greedy_chat(ref_llm, as_dicts, 8)
    assert second.choices[0].message.content == want.text
    assert second.usage.prompt_tokens == len(want.prompt_token_ids)


def test_model_may_be_omitted(server):
    # (and vLLM's extras and `user` are accepted at the top level)
    body = {"prompt": "Hi", "max_tokens": 2, "user": "u1", "priority": -1, "top_k": 5, "min_p": 0.1,
            "repetition_penalty": 1.1, "stop_token_ids": [2]}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


def test_finish_reasons_and_usage(client):
    # length: exactly max_tokens tokens
    r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    text = r.choices[0].text
    # stop: cut at a stop string taken from that very output
    stop = text.strip().split()[1]
    s = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=6, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].text == text[:text.index(stop)]
    assert stop not in s.choices[0].text
    assert 0 < s.usage.completion_tokens <= 6


def test_max_completion_tokens_wins(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                       max_tokens=20, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_n_choices_and_seeds(client):
    kw = dict(model=MODEL, prompt="My favourite animal is the", max_tokens=8, temperature=1.0,
              logprobs=0, extra_body={"ignore_eos": True})
    r = client.completions.create(n=2, seed=7, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices) == 16
    again = client.completions.create(n=2, seed=7, **kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices], "seeded sampling must repeat"
    # choice i samples with seed + i
    shifted = client.completions.create(n=1, seed=8, **kw)
    assert shifted.choices[0].text == r.choices[1].text


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something."}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for item in content:
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
    assert bytes(b for item in content for b in item.bytes).decode() == r.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something."}],
                                           max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_legacy_format(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and top[tok] == pytest.approx(tlp)
        assert max(top.values()) == pytest.approx(tlp, abs=1e-5)   # greedy


# -- streaming ------------------------------------------------------------------------------------

def test_chat_stream_sync(client):
    messages = [{"role": "user", "content": "Write one sentence about rivers."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    *body, last_choice_chunk, usage_chunk = chunks
    assert last_choice_chunk.choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.model_dump() == full.usage.model_dump()
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == full.choices[0].message.content
    assert all(c.choices[0].finish_reason is None for c in body)


def test_sse_framing(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: {"), e
        obj = json.loads(e[len("data: "):])
        assert "usage" not in obj, "usage appears only with stream_options.include_usage"


@pytest.mark.asyncio
async def test_completion_stream_async_matches_nonstream(server):
    async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0,
                                  timeout=REQUEST_TIMEOUT) as ac:
        kw = dict(model=MODEL, prompt="Rain is", max_tokens=10, temperature=0)
        full = await ac.completions.create(**kw)
        stream = await ac.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        chunks = [c async for c in stream]
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason


@pytest.mark.asyncio
async def test_async_concurrent_chats(server, ref_llm):
    questions = ["What is 2+2?", "Name a fruit.", "What colour is grass?"]
    async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0,
                                  timeout=REQUEST_TIMEOUT) as ac:
        async def ask(q: str, stream: bool) -> tuple[str, str]:
            msgs = [{"role": "user", "content": q}]
            if not stream:
                r = await ac.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
                return r.choices[0].message.content, r.choices[0].finish_reason
            text, finish = "", None
            async for c in await ac.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12,
                                                            temperature=0, stream=True):
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
            return text, finish
        got = await asyncio.gather(*(ask(q, i % 2 == 1) for i, q in enumerate(questions)))
    for q, (text, finish) in zip(questions, got):
        want = _greedy_chat(ref_llm, [{"role": "user", "content": q}], 12)
        assert (text, finish) == (want.text, want.finish_reason), q


def test_chat_stream_n2_logprobs(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a number."}], max_tokens=5, n=2, seed=3,
        temperature=1.0, logprobs=True, top_logprobs=1, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    per_choice: dict[int, int] = {0: 0, 1: 0}
    finishes = {}
    for c in chunks[:-1]:
        ch = c.choices[0]
        if ch.logprobs is not None:
            per_choice[ch.index] += len(ch.logprobs.content)
        if ch.finish_reason:
            finishes[ch.index] = ch.finish_reason
    assert per_choice == {0: 5, 1: 5}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 10


# -- tokenizer endpoints -------------------------------------------------------------------------

def test_tokenize_detokenize_round_trip(server, ref_llm, client):
    text = "Hello world, naïve café 日本"
    r = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": text}, timeout=10).json()
    assert r["tokens"] == ref_llm.tokenizer.encode(text)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 8192
    back = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": r["tokens"]}, timeout=10).json()
    assert back == {"prompt": text}
    # messages: the same tokens a chat request's prompt has
    msgs = [{"role": "user", "content": "Hi there"}]
    t = httpx.post(f"{server}/tokenize", json={"messages": msgs}, timeout=10).json()
    assert t["tokens"] == ref_llm.tokenizer.encode(ref_llm.chat_prompt(msgs), add_special_tokens=False)
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert chat.usage.prompt_tokens == t["count"]
    # content as text parts is the parts joined by newlines; "developer" is the system role
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    tp = httpx.post(f"{server}/tokenize", json={"messages": parts}, timeout=10).json()
    assert tp["tokens"] == httpx.post(f"{server}/tokenize", json={"messages": joined}, timeout=10).json()["tokens"]


# -- errors ---------------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "hi"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"

BAD_INPUTS = [
    # (id, path, body (bytes = raw), status, param, code)
    ("malformed-json", CHAT, b'{"messages": [', 400, None, None),
    ("body-not-object", CHAT, b"[1, 2]", 400, None, None),
    ("nan", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "temperature", None),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages", None),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages", None),
    ("messages-string", CHAT, {"messages": "hi"}, 400, "messages", None),
    ("tool-role-without-call-id", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]", None),
    ("no-content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0]", None),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content", None),
    ("unknown-field", CHAT, {"messages": MSGS, "foo": 1}, 400, "foo", None),
    ("temperature-high", CHAT, {"messages": MSGS, "temperature": 2.5}, 400, "temperature", None),
    ("temperature-type", CHAT, {"messages": MSGS, "temperature": "hot"}, 400, "temperature", None),
    ("top-p-zero", CHAT, {"messages": MSGS, "top_p": 0}, 400, "top_p", None),
    ("n-zero", CHAT, {"messages": MSGS, "n": 0}, 400, "n", None),
    ("n-string", CHAT, {"messages": MSGS, "n": "2"}, 400, "n", None),
    ("n-bool", CHAT, {"messages": MSGS, "n": True}, 400, "n", None),
    ("max-tokens-zero", CHAT, {"messages": MSGS, "max_tokens": 0}, 400, "max_tokens", None),
    ("max-tokens-float", CHAT, {"messages": MSGS, "max_tokens": 1.5}, 400, "max_tokens", None),
    ("max-completion-tokens-negative", CHAT, {"messages": MSGS, "max_completion_tokens": -1}, 400,
     "max_completion_tokens", None),
    ("presence-penalty", CHAT, {"messages": MSGS, "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ("frequency-penalty", CHAT, {"messages": MSGS, "frequency_penalty": -3}, 400, "frequency_penalty", None),
    ("five-stops", CHAT, {"messages": MSGS, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ("stop-type", CHAT, {"messages": MSGS, "stop": [1]}, 400, "stop", None),
    ("top-logprobs-range", CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("top-logprobs-alone", CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("stream-options-no-stream", CHAT, {"messages": MSGS, "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("seed-type", CHAT, {"messages": MSGS, "seed": "x"}, 400, "seed", None),
    ("top-k", CHAT, {"messages": MSGS, "top_k": -2}, 400, "top_k", None),
    ("stop-token-ids", CHAT, {"messages": MSGS, "stop_token_ids": [-1]}, 400, "stop_token_ids[0]", None),
    ("priority-type", CHAT, {"messages": MSGS, "priority": "high"}, 400, "priority", None),
    ("logit-bias", CHAT, {"messages": MSGS, "logit_bias": {"1": 5}}, 400, "logit_bias", None),
    ("tool-without-name", CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {}}]}, 400, "tools[0]",
     "invalid_tool"),
    ("chat-context", CHAT, {"messages": MSGS, "max_tokens": 100_000}, 400, "messages", "context_length_exceeded"),
    ("unknown-model", CHAT, {"model": "gpt-4", "messages": MSGS}, 404, "model", "model_not_found"),
    ("completion-logprobs", COMP, {"prompt": "x", "logprobs": 6}, 400, "logprobs", None),
    ("echo", COMP, {"prompt": "x", "echo": True}, 400, "echo", None),
    ("empty-prompt-list", COMP, {"prompt": []}, 400, "prompt", None),
    ("prompt-mixed-list", COMP, {"prompt": [1, "a"]}, 400, "prompt", None),
    ("empty-prompt", COMP, {"prompt": ""}, 400, "prompt", None),
    ("token-out-of-vocab", COMP, {"prompt": [10 ** 9]}, 400, "prompt", None),
    ("best-of", COMP, {"prompt": "x", "best_of": 3}, 400, "best_of", None),
    ("completion-context", COMP, {"prompt": "x", "max_tokens": 9000}, 400, "prompt", "context_length_exceeded"),
    ("unknown-model-completion", COMP, {"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
    ("tokenize-nothing", "/tokenize", {}, 400, "prompt", None),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [10 ** 9]}, 400, "tokens[0]", None),
    ("detokenize-negative", "/detokenize", {"tokens": [-1]}, 400, "tokens[0]", None),
    ("unknown-route", "/v1/nothing-here", {}, 404, None, "not_found"),
]


@pytest.mark.parametrize("path,body,status,param,code", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_openai_error(server, path, body, status, param, code):
    if isinstance(body, bytes):
        r = httpx.post(server + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(server + path, json=body, timeout=30)
    _assert_error(r, status, param, code)


def test_unknown_field_message_and_wrong_method(server):
    err = _assert_error(httpx.post(server + CHAT, json={"messages": MSGS, "foo": 1}, timeout=30), 400)
    assert err["message"] == "Unrecognized request argument supplied: foo"
    _assert_error(httpx.get(server + CHAT, timeout=30), 405)


def test_prompt_over_context_names_both_numbers(server):
    prompt = "hello " * 9000
    n = httpx.post(f"{server}/tokenize", json={"prompt": prompt}, timeout=30).json()["count"]
    assert n > 8192
    err = _assert_error(httpx.post(server + COMP, json={"prompt": prompt}, timeout=60), 400, "prompt",
                        "context_length_exceeded")
    assert str(n) in err["message"] and "8192" in err["message"]
    # prompt + max_tokens over the context: the sum and both parts are named
    err = _assert_error(httpx.post(server + COMP, json={"prompt": "hello " * 100, "max_tokens": 8150}, timeout=60),
                        400, "prompt", "context_length_exceeded")
    assert "8192" in err["message"] and "8150" in err["message"]


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, temperature=5)
    assert e.value.status_code == 400 and "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MSGS)


# -- metrics and aborts ---------------------------------------------------------------------------

def _wait_metric(server: str, cond, timeout: float = 30.0) -> dict[str, float]:
    t0 = time.monotonic()
    while True:
        m = metrics(server)
        if cond(m):
            return m
        assert time.monotonic() - t0 < timeout, {k: v for k, v in m.items() if "bucket" not in k}
        time.sleep(0.05)


def test_metrics_follow_requests(server, client):
    before = metrics(server)
    r = client.completions.create(model=MODEL, prompt="Metrics are", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metrics(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("slipstream_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("slipstream_generation_tokens_total") == r.usage.completion_tokens == 5
    assert delta('slipstream_request_success_total{finished_reason="length"}') == 1
    assert delta("slipstream_time_to_first_token_seconds_count") == 1
    assert delta("slipstream_inter_token_latency_seconds_count") == 4
    assert delta("slipstream_e2e_request_latency_seconds_count") == 1
    assert delta("slipstream_request_queue_time_seconds_count") == 1
    assert delta("slipstream_prefix_cache_queries_total") > 0   # prompt tokens looked up
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_blocks_in_use"):
        assert after[f"slipstream_{gauge}"] == 0.0, gauge
    assert after["slipstream_kv_blocks_total"] > 0
    for counter in ("prefix_cache_hits_total", "merged_requests_total", "preemptions_total"):
        assert f"slipstream_{counter}" in after


def test_client_disconnect_aborts_request(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 3:
                    break
    key = 'slipstream_request_success_total{finished_reason="abort"}'
    m = _wait_metric(server, lambda m: m[key] == before[key] + 1 and m["slipstream_num_requests_running"] == 0)
    assert m["slipstream_kv_blocks_in_use"] == 0.0
    assert m["slipstream_generation_tokens_total"] - before["slipstream_generation_tokens_total"] < 4000
    # not streaming: a client that stops waiting gets its request aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=dict(body, stream=False), timeout=httpx.Timeout(30, read=1.0))
    m = _wait_metric(server, lambda m: m[key] == before[key] + 2 and m["slipstream_num_requests_running"] == 0)
    assert m["slipstream_kv_blocks_in_use"] == 0.0
