"""The scheduling layer seen from outside: many concurrent clients, clients that leave mid-stream,
a shared prompt prefix, identical requests in flight. Each test drives the live server with the
real `openai` async client and reads /metrics, as an operator would."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest
from server_support import REQUEST_TIMEOUT, metrics

MODEL = "smollm2-135m"
TOPICS = ["rivers", "volcanoes", "bread", "chess", "owls", "glaciers", "tea", "bridges", "comets", "violins",
          "deserts", "bees", "lighthouses", "maps", "coral", "trains", "clocks", "ferns", "kites", "caves",
          "salt", "wolves", "paper", "tides", "copper", "moss", "lanterns", "whales", "sand", "orchards",
          "storms", "ink"]


def aclient(server: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)


async def stream_chat(c: openai.AsyncOpenAI, content: str, max_tokens: int, **extra) -> tuple[str, int, float]:
    """(text, completion tokens from usage, seconds to the first content chunk)."""
    t0 = time.perf_counter()
    ttft = None
    text = ""
    usage = None
    stream = await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra or None)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += ch.delta.content
    assert usage is not None
    return text, usage.completion_tokens, ttft if ttft is not None else float("nan")


def wait_idle(server: str, timeout: float = 120.0) -> dict[str, float]:
    t0 = time.monotonic()
    while True:
        m = metrics(server)
        if m["slipstream_num_requests_running"] == 0 and m["slipstream_num_requests_waiting"] == 0:
            return m
        assert time.monotonic() - t0 < timeout, "the server did not go idle"
        time.sleep(0.1)


def test_32_concurrent_streams_finish_with_the_tokens_they_get_alone(server):
    async def main():
        async with aclient(server) as c:
            prompts = [f"Write two sentences about {t}." for t in TOPICS]
            alone = await stream_chat(c, prompts[5], 16, ignore_eos=True)
            together = await asyncio.gather(*(stream_chat(c, p, 16, ignore_eos=True) for p in prompts))
            return alone, together

    alone, together = asyncio.run(main())
    assert len(together) == 32
    assert all(n == 16 for _, n, _ in together)          # usage: exactly max_tokens each
    assert together[5][0] == alone[0]                    # batching did not change a greedy answer
    assert len({text for text, _, _ in together}) > 20   # and they are different answers
    assert wait_idle(server)["slipstream_kv_blocks_in_use"] == 0


def test_200_streams_cut_midway_leave_no_kv_blocks_in_use(server):
    before = metrics(server)

    async def cut(c: openai.AsyncOpenAI, i: int) -> int:
        stream = await c.completions.create(model=MODEL, prompt=f"Story {i} about {TOPICS[i % 32]}:",
                                            max_tokens=500, temperature=0.7, seed=i, stream=True,
                                            extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen >= 1 + i % 3:
                break
        await stream.close()
        return seen

    async def main():
        async with aclient(server) as c:
            return await asyncio.gather(*(cut(c, i) for i in range(200)))

    seen = asyncio.run(main())
    assert len(seen) == 200 and min(seen) >= 1
    m = wait_idle(server)
    key = 'slipstream_request_success_total{finished_reason="abort"}'
    assert m[key] - before.get(key, 0.0) == 200
    assert m["slipstream_kv_blocks_in_use"] == 0
    assert m["slipstream_kv_cache_usage_perc"] == 0
    assert m["slipstream_generation_tokens_total"] - before["slipstream_generation_tokens_total"] < 200 * 100


def test_a_shared_prefix_hits_the_cache_and_lowers_ttft(server):
    system = ("You are the on-call assistant of a storage team. Answer with the exact command first, then "
              "one sentence of explanation. The cluster runs Ceph 18 on 40 nodes; pools are replicated "
              "three ways; never suggest deleting a placement group. ") * 12

    async def ask(c, question: str) -> float:
        t0 = time.perf_counter()
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True})
        ttft = None
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:   # not the role chunk
                ttft = time.perf_counter() - t0
        return ttft

    async def main():
        async with aclient(server) as c:
            first = await ask(c, "How do I list the pools?")
            mid = metrics(server)
            second = await ask(c, "How do I check cluster health?")
            return first, mid, second

    before = metrics(server)
    first, mid, second = asyncio.run(main())
    after = metrics(server)
    hits = "slipstream_prefix_cache_hits_total"
    assert mid[hits] - before[hits] < 64                     # the first saw a cold cache
    assert after[hits] - mid[hits] >= 512                    # the second found the system prompt
    assert second < 0.6 * first, (first, second)


def test_two_identical_concurrent_requests_are_merged(server):
    async def main():
        async with aclient(server) as c:
            body = dict(model=MODEL, messages=[{"role": "user", "content": "Name three famous bridges."}],
                        max_tokens=24, temperature=0)
            return await asyncio.gather(c.chat.completions.create(**body), c.chat.completions.create(**body))

    before = metrics(server)
    a, b = asyncio.run(main())
    after = metrics(server)
    assert after["slipstream_merged_requests_total"] - before["slipstream_merged_requests_total"] == 1
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == b.usage.completion_tokens > 0
    assert a.id != b.id


@pytest.mark.parametrize("n", [3])
def test_greedy_choices_are_merged_into_one_computation(server, n):
    async def main():
        async with aclient(server) as c:
            return await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say something about owls."}],
                max_tokens=8, temperature=0, n=n)

    before = metrics(server)
    r = asyncio.run(main())
    after = metrics(server)
    assert len({ch.message.content for ch in r.choices}) == 1
    assert after["slipstream_merged_requests_total"] - before["slipstream_merged_requests_total"] == n - 1
    assert r.usage.completion_tokens == n * 8 or r.choices[0].finish_reason == "stop"


def test_ngram_speculation_in_the_server_is_lossless_and_counted(start_server):
    from slipstream import LLM, SamplingParams

    srv = start_server("--speculative", "ngram", "--num-speculative-tokens", "4", "--max-model-len", "1024")
    echo = ["Original: the cat sat on the mat by the door.\nCopy: the cat sat on the mat by the door.\n"
            "Original: the cat sat on the mat by the door.\nCopy:",
            "a b c d e f g h a b c d e f g h a b c d"]

    async def main():
        async with aclient(srv.base_url) as c:
            return await asyncio.gather(*(c.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0,
                                                               extra_body={"ignore_eos": True}) for p in echo))

    outs = asyncio.run(main())
    ref = LLM(max_model_len=1024).generate(echo, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert [o.choices[0].text for o in outs] == [r.text for r in ref]
    m = metrics(srv.base_url)
    assert m["slipstream_spec_decode_num_accepted_tokens_total"] > 0
    assert m["slipstream_spec_decode_num_draft_tokens_total"] >= m["slipstream_spec_decode_num_accepted_tokens_total"]
    assert m['slipstream_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert m["slipstream_kv_blocks_in_use"] == 0
