"""The continuous-batching engine on the embedded SmolLM2 GGUF: requests joining and leaving every
step, chunked prefill, prefix reuse, preemption, priorities, request merging, aborts and the queue
bound. Every scenario checks the tokens against the same request run alone, and that no KV block
stays in use afterwards."""
from __future__ import annotations

import pytest
from support import engine

from slipstream import LLM, SamplingParams
from slipstream.engine.engine import Engine
from slipstream.engine.request import Request
from slipstream.errors import QueueFullError

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colours of the rainbow, separated by commas, and explain why the sky is blue "
    "in one sentence that a child would understand.",
    "Once upon a time",
    "Water boils at 100 degrees Celsius at sea level. At the top of a high mountain it boils at",
    "1, 2, 3, 4, 5,",
]
SYSTEM = ("You are a meticulous assistant for a team of compiler engineers. Answer precisely, cite the "
          "relevant part of the C standard when it matters, prefer short code examples, and never "
          "invent flags that GCC or Clang do not have. ") * 2


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text)


def drain(e: Engine, reqs: list[Request], max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if all(r.finished for r in reqs) and not e.has_unfinished():
            break
        e.step()
    assert all(r.finished for r in reqs)


def alone(llm: LLM, prompt_ids: list[int], params: SamplingParams, exact: bool | None = None) -> list[int]:
    """The tokens of one request run by itself (no prefix cache) on a fresh engine; `exact` picks the
    CPU path (None: the LLM's)."""
    e = engine(llm, enable_prefix_cache=False, **({} if exact is None else {"exact": exact}))
    r = Request(list(prompt_ids), params)
    e.add_request(r)
    drain(e, [r])
    return r.output_ids


def assert_idle(e: Engine) -> None:
    s = e.stats()
    assert (s.num_running, s.num_waiting, s.kv_blocks_in_use) == (0, 0, 0)
    assert not e.requests


def test_requests_join_and_leave_every_step_with_the_tokens_they_get_alone(llm):
    e = engine(llm, prefill_chunk=16, max_batch=4)
    lengths = [5, 12, 20, 9, 16, 7]
    reqs = [Request(ids(llm, p), greedy(n)) for p, n in zip(PROMPTS, lengths)]
    e.add_request(reqs[0])
    e.add_request(reqs[1])
    pending = reqs[2:]
    batch_sizes = []
    for _ in range(1000):
        if pending and len(batch_sizes) % 3 == 2:   # arrivals while others decode
            e.add_request(pending.pop(0))
        if not pending and not e.has_unfinished():
            break
        e.step()
        batch_sizes.append(e.stats().num_running)
    assert max(batch_sizes) == 4                    # the batch filled up to max_batch ...
    assert len(set(batch_sizes)) > 2                # ... and changed size as requests came and went
    for r, n in zip(reqs, lengths):
        assert r.finish_reason in ("stop", "length")
        assert r.output_ids == alone(llm, r.prompt_ids, greedy(n)), r.prompt
    assert_idle(e)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(llm):
    e = engine(llm, prefill_chunk=24)
    short = Request(ids(llm, PROMPTS[0]), greedy(40, ignore_eos=True))
    e.add_request(short)
    e.step()                                           # short is prefilled and decoding
    long_ids = ids(llm, SYSTEM + "Explain undefined behaviour.")
    assert len(long_ids) > 3 * 24
    long = Request(long_ids, greedy(4))
    e.add_request(long)
    tokens_during_prefill = 0
    while long.kv is None or long.kv.num_tokens < len(long_ids):
        before = len(short.output_ids)
        e.step()
        tokens_during_prefill += len(short.output_ids) - before
    assert tokens_during_prefill >= 3        # one decode token per prefill chunk, not a stall
    drain(e, [short, long])
    assert long.output_ids == alone(llm, long_ids, greedy(4))
    assert short.output_ids == alone(llm, short.prompt_ids, greedy(40, ignore_eos=True))
    assert_idle(e)


def test_a_shared_prefix_is_computed_once(llm):
    e = engine(llm, prefill_chunk=512)
    first = Request(ids(llm, SYSTEM + "What does -O2 enable?"), greedy(6))
    e.add_request(first)
    drain(e, [first])
    second_ids = ids(llm, SYSTEM + "Is signed overflow undefined?")
    second = Request(second_ids, greedy(6))
    e.add_request(second)
    drain(e, [second])
    common = next(i for i, (a, b) in enumerate(zip(first.prompt_ids, second_ids)) if a != b)
    bs = e.kv.block_size
    assert second.metrics.num_cached_prompt_tokens == common // bs * bs > 64
    s = e.stats()
    assert s.prefix_cache_hit_tokens == second.metrics.num_cached_prompt_tokens
    assert s.prefix_cache_queried_tokens == len(first.prompt_ids) - 1 + len(second_ids) - 1
    assert second.output_ids == alone(llm, second_ids, greedy(6))
    assert_idle(e)   # cached blocks are not "in use": they are recycled when needed


def test_a_conversation_reuses_the_previous_answer(llm):
    e = engine(llm)
    turn1 = Request(ids(llm, SYSTEM + "Name a C compiler."), greedy(24, ignore_eos=True))
    e.add_request(turn1)
    drain(e, [turn1])
    turn2_ids = turn1.prompt_ids + turn1.output_ids + ids(llm, " And another one?")
    turn2 = Request(turn2_ids, greedy(4))
    e.add_request(turn2)
    drain(e, [turn2])
    bs = e.kv.block_size
    # everything up to the last full block of turn 1 (prompt and generated tokens) was reused
    assert turn2.metrics.num_cached_prompt_tokens == (turn1.num_tokens - 1) // bs * bs
    assert turn2.metrics.num_cached_prompt_tokens > len(turn1.prompt_ids)


def test_preemption_when_blocks_run_out_keeps_every_answer(llm):
    # 6 sequences of ~60 tokens each in a cache of 160 tokens: they cannot all fit at once
    e = engine(llm, kv_cache_tokens=160, max_batch=6)
    reqs = [Request(ids(llm, p), greedy(40, ignore_eos=True)) for p in PROMPTS]
    for r in reqs:
        e.add_request(r)
    drain(e, reqs)
    assert e.stats().preemptions > 0
    assert any(r.num_preemptions for r in reqs)
    for r in reqs:
        assert len(r.output_ids) == 40
        assert r.output_ids == alone(llm, r.prompt_ids, greedy(40, ignore_eos=True)), r.prompt
    assert_idle(e)


def test_a_better_priority_goes_first_and_preempts_the_worst(llm):
    e = engine(llm, max_batch=1)
    slow = Request(ids(llm, PROMPTS[3]), greedy(30, ignore_eos=True), priority=5)
    e.add_request(slow)
    e.step()
    e.step()
    urgent = Request(ids(llm, PROMPTS[0]), greedy(3, ignore_eos=True), priority=-1)
    e.add_request(urgent)
    order = []
    while e.has_unfinished():
        for ev in e.step():
            if ev.request.finished:
                order.append(ev.request)
    assert order == [urgent, slow]
    assert slow.num_preemptions == 1
    assert slow.output_ids == alone(llm, slow.prompt_ids, greedy(30, ignore_eos=True))
    assert_idle(e)


def test_waiting_requests_are_served_by_priority_then_arrival(llm):
    e = engine(llm, max_batch=1)
    reqs = [Request(ids(llm, PROMPTS[i]), greedy(2, ignore_eos=True), priority=p)
            for i, p in enumerate((3, 1, 2, 1))]
    for r in reqs:
        e.add_request(r)
    order = []
    while e.has_unfinished():
        order += [ev.request for ev in e.step() if ev.request.finished]
    assert order == [reqs[1], reqs[3], reqs[2], reqs[0]]


def test_a_merged_request_lends_its_priority_to_the_computation(llm):
    e = engine(llm, max_batch=1)
    p = ids(llm, PROMPTS[0])
    first = Request(ids(llm, PROMPTS[1]), greedy(2, ignore_eos=True))
    low = Request(p, greedy(2, ignore_eos=True), priority=9)
    mid = Request(ids(llm, PROMPTS[2]), greedy(2, ignore_eos=True), priority=5)
    for r in (first, low, mid):
        e.add_request(r)
    e.step()
    high = Request(list(p), greedy(2, ignore_eos=True), priority=0)   # merges into `low`
    e.add_request(high)
    order = []
    while e.has_unfinished():
        order += [ev.request for ev in e.step() if ev.request.finished]
    assert order.index(high) < order.index(mid) and order.index(low) < order.index(mid)


def test_identical_requests_in_flight_are_computed_once(llm):
    e = engine(llm)
    p = ids(llm, PROMPTS[2])
    a, b = Request(p, greedy(10)), Request(list(p), greedy(10))
    c = Request(list(p), greedy(11))            # different parameters: not merged
    for r in (a, b, c):
        e.add_request(r)
    got: dict[str, list[int]] = {a.request_id: [], b.request_id: [], c.request_id: []}
    texts: dict[str, str] = {a.request_id: "", b.request_id: ""}
    while e.has_unfinished():
        for ev in e.step():
            got[ev.request.request_id] += ev.token_ids
            texts[ev.request.request_id] = texts.get(ev.request.request_id, "") + ev.text
    assert e.stats().merged_requests == 1
    assert got[a.request_id] == got[b.request_id] == a.output_ids == b.output_ids
    assert texts[a.request_id] == texts[b.request_id] == a.text == b.text
    assert b.finish_reason == a.finish_reason
    assert len(e.scheduler.running) == 0
    assert_idle(e)


def test_a_late_identical_request_catches_up_and_seeded_sampling_merges_too(llm):
    e = engine(llm)
    p = ids(llm, PROMPTS[1])
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    a = Request(p, params)
    e.add_request(a)
    for _ in range(4):
        e.step()
    b = Request(list(p), SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True))
    e.add_request(b)
    got_b: list[int] = []
    while e.has_unfinished():
        got_b += [t for ev in e.step() if ev.request is b for t in ev.token_ids]
    assert e.stats().merged_requests == 1
    assert got_b == a.output_ids and len(got_b) == 12
    unseeded = [Request(list(p), SamplingParams(max_tokens=2, temperature=0.8)) for _ in range(2)]
    for r in unseeded:
        e.add_request(r)
    drain(e, unseeded)
    assert e.stats().merged_requests == 1     # random sampling without a seed is never merged


def test_the_follower_goes_on_when_the_first_caller_leaves(llm):
    e = engine(llm)
    p = ids(llm, PROMPTS[4])
    a, b = Request(p, greedy(10, ignore_eos=True)), Request(list(p), greedy(10, ignore_eos=True))
    e.add_request(a)
    e.add_request(b)
    e.step()
    e.step()
    e.abort(a.request_id)
    seen_a = []
    while e.has_unfinished():
        seen_a += [ev for ev in e.step() if ev.request is a]
    assert not seen_a                         # the caller that left gets nothing more
    assert b.finish_reason == "length" and len(b.output_ids) == 10
    assert b.output_ids == alone(llm, p, greedy(10, ignore_eos=True))
    assert_idle(e)


def test_abort_frees_blocks_wherever_the_request_is(llm):
    e = engine(llm, max_batch=2, prefill_chunk=16)
    reqs = [Request(ids(llm, SYSTEM + str(i)), greedy(50, ignore_eos=True)) for i in range(4)]
    for r in reqs:
        e.add_request(r)
    e.step()
    e.step()
    states = {("waiting" if r in e.scheduler.waiting else "running") for r in reqs}
    assert states == {"waiting", "running"}
    for r in reqs:
        e.abort(r.request_id)
        assert r.finish_reason == "abort"
    assert e.step() == []
    assert_idle(e)
    e.abort("no-such-request")               # unknown ids are ignored


def test_the_waiting_queue_is_bounded(llm):
    e = engine(llm, max_batch=1, max_waiting=2)
    reqs = [Request(ids(llm, PROMPTS[0]), greedy(2, ignore_eos=True)) for _ in range(3)]
    reqs = [Request(ids(llm, p), greedy(2)) for p in PROMPTS[:3]]
    e.add_request(reqs[0])
    e.add_request(reqs[1])
    with pytest.raises(QueueFullError, match="overloaded"):
        e.add_request(reqs[2])
    drain(e, reqs[:2])
    e.add_request(reqs[2])                   # room again
    drain(e, reqs[2:])
    assert_idle(e)


def test_max_tokens_zero_finishes_without_running(llm):
    e = engine(llm)
    r = Request(ids(llm, PROMPTS[0]), greedy(0))
    e.add_request(r)
    events = e.step()
    assert [(ev.request, ev.token_ids) for ev in events] == [(r, [])]
    assert r.finish_reason == "length"
    assert_idle(e)


def test_a_late_follower_has_sane_timings_and_leaving_restores_priority(llm):
    e = engine(llm, max_batch=1)
    first = Request(ids(llm, PROMPTS[0]), greedy(6, ignore_eos=True))
    low = Request(ids(llm, PROMPTS[1]), greedy(6, ignore_eos=True), priority=9)
    mid = Request(ids(llm, PROMPTS[2]), greedy(6, ignore_eos=True), priority=5)
    for r in (first, low, mid):
        e.add_request(r)
    high = Request(list(low.prompt_ids), greedy(6, ignore_eos=True), priority=0)
    e.add_request(high)                   # merged into `low`, which now runs at priority 0 ...
    assert low.priority == 0
    e.abort(high.request_id)              # ... until that caller leaves
    assert low.priority == 9
    drain(e, [first, low, mid])
    # a follower joining after the primary's first token: its timings start at its own arrival
    a = Request(ids(llm, PROMPTS[3]), greedy(12, ignore_eos=True))
    e.add_request(a)
    for _ in range(3):
        e.step()
    b = Request(list(a.prompt_ids), greedy(12, ignore_eos=True))
    e.add_request(b)
    drain(e, [a, b])
    assert b.metrics.ttft_s >= 0 and b.metrics.queue_s >= 0 and b.metrics.finished >= b.metrics.arrival
    assert_idle(e)


def test_aborting_a_request_that_finished_in_a_failed_step_frees_it(llm):
    e = engine(llm)
    r = Request(ids(llm, PROMPTS[0]), greedy(3, ignore_eos=True))
    e.add_request(r)
    e.step()
    r.finish_reason = "stop"              # as if the step had failed after it finished
    e.abort(r.request_id)
    assert_idle(e)


def test_stop_strings_are_cut_and_a_possible_start_of_one_is_held_back():
    """Output processing without a model: the text a stop string could still grow from is not final."""
    from slipstream.engine.output import check_stop_strings, final_text, held_back

    r = Request([1, 2], SamplingParams(max_tokens=8, stop=["END", "##"]))
    r.text = "hello E"
    assert held_back(r) == 1 and final_text(r, 0.0) == "hello " and r.emitted == 6
    r.text = "hello EN"
    assert held_back(r) == 2 and final_text(r, 0.0) == ""
    r.text = "hello ENDING"
    check_stop_strings(r, len("hello EN"))
    assert r.text == "hello " and r.finish_reason == "stop" and final_text(r, 1.0) == ""
    r2 = Request([1], SamplingParams(max_tokens=8, stop=["##"]))
    r2.text = "a #"
    assert held_back(r2) == 1 and final_text(r2, 0.0) == "a "
