"""The Python API (`slipstream.LLM`) driven the way a user drives it, on the embedded SmolLM2 GGUF:
batching, chat, streaming, stop strings, limits, seeds, logprobs, metrics, and errors that leave
the engine usable (no leaked KV blocks)."""
from __future__ import annotations

import re

import pytest
from support import skip_unless_default_model
import torch

from slipstream import LLM, SamplingParams
from slipstream.errors import PromptTooLongError, SlipstreamError
from slipstream.kv.blocks import SequenceKV
from slipstream.runtime.registry import prefill_capacity
from slipstream.step import prefill_step

GREEDY = dict(temperature=0)
PROMPTS = ["The capital of France is", "def quicksort(arr):"]
STREAM_PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "Translate 'good morning' into Japanese, Chinese and Korean:",   # multi-byte characters
    "日本の首都は",
    "Emoji list: 😀 😂 👍 🎉",                                          # characters split across tokens
]
MESSAGES = [{"role": "user", "content": "Tell me a short story about a dragon."}]


# every LLM built here, with the free KV blocks of its idle engine
_IDLE_FREE: dict[int, tuple[LLM, int]] = {}


def _make(**kw) -> LLM:
    m = LLM(**kw)
    _IDLE_FREE[id(m)] = (m, m.engine.kv.allocator.num_free)
    return m


@pytest.fixture(scope="module")
def llm() -> LLM:
    skip_unless_default_model()
    return _make()


@pytest.fixture(scope="module")
def free0(llm) -> int:
    return _IDLE_FREE[id(llm)][1]


@pytest.fixture(autouse=True)
def _no_leaked_blocks():
    """Whatever a test did (errors, stop strings, abandoned streams), no engine keeps KV blocks."""
    yield
    leaked = []
    for m, free in _IDLE_FREE.values():
        alloc = m.engine.kv.allocator
        if alloc.num_free != free:
            leaked.append(free - alloc.num_free)
            alloc.free([b for b in range(alloc.num_blocks) if alloc.ref_count[b] > 0])  # next test starts clean
    assert not leaked, f"KV blocks leaked: {leaked}"


def _gen(llm: LLM, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw))[0]


def _stream(llm: LLM, prompt, **kw):
    chunks = list(llm.stream(prompt, SamplingParams(**kw)))
    assert chunks, "a stream yields at least one chunk"
    return chunks


# -- batching ---------------------------------------------------------------------------------------

def test_batch_equals_each_prompt_alone(llm, free0):
    params = SamplingParams(max_tokens=12, **GREEDY)
    outs = llm.generate(PROMPTS, params)
    assert len(outs) == 2
    for prompt, out in zip(PROMPTS, outs):
        alone = llm.generate([prompt], params)
        assert len(alone) == 1
        assert out.prompt == prompt
        assert out.prompt_token_ids == alone[0].prompt_token_ids == llm.tokenizer.encode(prompt)
        assert out.token_ids == alone[0].token_ids
        assert out.text == alone[0].text
        assert out.finish_reason == alone[0].finish_reason
    assert outs[0].request_id != outs[1].request_id


def test_single_string_and_token_ids_prompts(llm):
    params = SamplingParams(max_tokens=8, **GREEDY)
    by_text = llm.generate(PROMPTS[0], params)
    by_ids = llm.generate(llm.tokenizer.encode(PROMPTS[0]), params)
    assert len(by_text) == len(by_ids) == 1
    assert by_text[0].token_ids == by_ids[0].token_ids and by_text[0].text == by_ids[0].text
    assert llm.generate([], params) == []


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    alone = llm.generate(PROMPTS[1], params)[0]
    batched = llm.generate([PROMPTS[0], PROMPTS[1]], params)[1]
    assert batched.token_ids == alone.token_ids


# -- chat and streaming ------------------------------------------------------------------------------

def test_chat(llm):
    outs = llm.chat(MESSAGES, SamplingParams(max_tokens=48, **GREEDY))
    assert len(outs) == 1
    out = outs[0]
    assert out.text.strip() and out.finish_reason in {"stop", "length"}
    # the prompt is the rendered chat template, encoded without adding BOS again
    rendered = llm.chat_prompt(MESSAGES)
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    # a batch of conversations
    two = llm.chat([MESSAGES, [{"role": "user", "content": "Hi!"}]], SamplingParams(max_tokens=8, **GREEDY))
    assert len(two) == 2 and two[0].token_ids == out.token_ids[:8]


def test_chat_stops_at_end_of_turn(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=200, **GREEDY))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text


@pytest.mark.parametrize("prompt", STREAM_PROMPTS + [MESSAGES])
def test_stream_matches_generate(llm, prompt):
    params = dict(max_tokens=40, ignore_eos=True, **GREEDY)
    chunks = _stream(llm, prompt, **params)
    final = chunks[-1].request
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert all(c.request is final for c in chunks)
    text = "".join(c.text for c in chunks)
    assert text == final.text
    assert [t for c in chunks for t in c.token_ids] == final.output_ids
    if isinstance(prompt, list):
        ref = llm.chat(prompt, SamplingParams(**params))[0]
    else:
        ref = _gen(llm, prompt, **params)
    assert text == ref.text and final.output_ids == ref.token_ids
    assert text == llm.tokenizer.decode(final.output_ids)
    for c in chunks[:-1]:
        assert "\ufffd" not in c.text, f"a chunk holds half a character: {c.text!r}"
    if "\ufffd" in chunks[-1].text:
        # only where generation stopped in the middle of a character: the full decode has it too
        assert final.finish_reason == "length" and llm.tokenizer.decode(final.output_ids).endswith("\ufffd")


def test_stream_multibyte_text_is_really_streamed(llm):
    chunks = _stream(llm, STREAM_PROMPTS[2], max_tokens=24, ignore_eos=True, **GREEDY)
    text = "".join(c.text for c in chunks)
    assert any(ord(ch) > 0x3000 for ch in text)       # CJK output...
    assert sum(1 for c in chunks if c.text) > 3       # ...emitted piece by piece, not all at the end


# -- stop strings -------------------------------------------------------------------------------------

def _stop_cases(text: str) -> list[str]:
    """Stop strings taken from a greedy output: a word in the middle, and a string that straddles
    two words (so it spans a token boundary and starts inside a token)."""
    words = [m for m in re.finditer(r"[A-Za-z]{4,}", text) if m.start() > 10]
    assert len(words) >= 3, text
    w1, w2 = words[len(words) // 2], words[len(words) // 2 + 1]
    return [w1.group(), text[w1.end() - 2: w2.start() + 2]]


@pytest.mark.parametrize("which", [0, 1])
def test_stop_string(llm, which):
    prompt = "Once upon a time, in a small village by the sea,"
    full = _gen(llm, prompt, max_tokens=48, ignore_eos=True, **GREEDY)
    stop = _stop_cases(full.text)[which]
    expected = full.text[: full.text.index(stop)]

    out = _gen(llm, prompt, max_tokens=48, ignore_eos=True, stop=[stop], **GREEDY)
    assert out.text == expected
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]

    # streaming: never hand out text that the stop string later takes back
    seen = ""
    chunks = list(llm.stream(prompt, SamplingParams(max_tokens=48, ignore_eos=True, stop=stop, **GREEDY)))
    for c in chunks:
        seen += c.text
        assert expected.startswith(seen), f"streamed {seen!r}, beyond the final text {expected!r}"
    assert seen == expected and chunks[-1].finish_reason == "stop"


def test_stop_string_among_several(llm):
    prompt = "Once upon a time, in a small village by the sea,"
    full = _gen(llm, prompt, max_tokens=48, ignore_eos=True, **GREEDY).text
    first, later = _stop_cases(full)
    # the earliest match wins whatever the order of the list; absent strings do no harm
    out = _gen(llm, prompt, max_tokens=48, ignore_eos=True, stop=["zzqx-absent", later, first], **GREEDY)
    assert out.text == full[: min(full.index(first), full.index(later))]
    assert out.finish_reason == "stop"


def test_stop_token_ids(llm):
    full = _gen(llm, PROMPTS[0], max_tokens=16, ignore_eos=True, **GREEDY)
    k = 5
    out = _gen(llm, PROMPTS[0], max_tokens=16, ignore_eos=True, stop_token_ids=[full.token_ids[k]], **GREEDY)
    first = full.token_ids.index(full.token_ids[k])
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop"


# -- limits, seeds, logprobs, metrics --------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 5, 17])
def test_max_tokens(llm, n):
    out = _gen(llm, PROMPTS[0], max_tokens=n, ignore_eos=True, **GREEDY)
    assert len(out.token_ids) == n
    assert out.finish_reason == "length"
    assert out.metrics.num_output_tokens == n


def test_max_tokens_zero(llm):
    out = _gen(llm, PROMPTS[0], max_tokens=0)
    assert out.text == "" and out.token_ids == []
    assert out.finish_reason == "length"
    chunks = _stream(llm, PROMPTS[0], max_tokens=0)
    assert "".join(c.text for c in chunks) == "" and chunks[-1].finish_reason == "length"


def test_seeds(llm):
    def sample(seed):
        return _gen(llm, PROMPTS[0], max_tokens=32, temperature=1.0, seed=seed, ignore_eos=True)

    a, b, c = sample(1234), sample(1234), sample(4321)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids


def test_logprobs(llm):
    out = _gen(llm, PROMPTS[0], max_tokens=8, logprobs=3, ignore_eos=True, **GREEDY)
    assert len(out.logprobs) == len(out.token_ids) == 8
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok
        assert lp.logprob <= 0
        assert len(lp.top) == 3
        ids, vals = zip(*lp.top)
        assert len(set(ids)) == 3 and list(vals) == sorted(vals, reverse=True)
        # greedy: the sampled token is the best alternative
        assert ids[0] == tok and lp.logprob == pytest.approx(vals[0], abs=1e-6)
    # the first logprob is the model's log-softmax after the prompt, computed where the engine computed
    # it: the runtime's own step when the prompt fits its prefill capacity, else the eager step
    ids = out.prompt_token_ids
    n = len(ids)
    eng = llm.engine
    seq = SequenceKV(eng.kv)
    seq.reserve(n)
    try:
        step = prefill_step(seq, ids)
        logits = eng.runtime.forward(step) if n <= prefill_capacity(eng.runtime) else llm.model.forward(step, eng.kv)
    finally:
        seq.release()
    logp = torch.log_softmax(logits[0].float(), -1)
    assert out.logprobs[0].logprob == pytest.approx(logp[out.token_ids[0]].item(), abs=1e-4)
    for t, v in out.logprobs[0].top:
        assert v == pytest.approx(logp[t].item(), abs=1e-4)
    # sampled tokens report their own logprob, not the best one's
    hot = _gen(llm, PROMPTS[0], max_tokens=16, logprobs=0, temperature=1.5, seed=3, ignore_eos=True)
    assert all(lp.top == [] and lp.token_id == t for lp, t in zip(hot.logprobs, hot.token_ids))
    assert len(hot.logprobs) == 16
    no = _gen(llm, PROMPTS[0], max_tokens=4, **GREEDY)
    assert no.logprobs == []


def test_metrics(llm):
    out = _gen(llm, PROMPTS[0], max_tokens=8, ignore_eos=True, **GREEDY)
    m = out.metrics
    assert m.ttft_s is not None and m.ttft_s > 0
    assert m.decode_tok_s is not None and m.decode_tok_s > 0
    assert m.finished >= m.first_token >= m.arrival


# -- errors and KV hygiene ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(llm) -> LLM:
    return _make(max_model_len=32)


@pytest.fixture(scope="module")
def small_exact(llm) -> LLM:
    return _make(max_model_len=32, exact=True)


def test_prompt_too_long(small):
    free = small.engine.kv.allocator.num_free
    prompt = "word " * 60
    n = len(small.tokenizer.encode(prompt))
    assert n > 32
    with pytest.raises(PromptTooLongError) as e:
        small.generate(prompt, SamplingParams(max_tokens=4))
    assert isinstance(e.value, SlipstreamError)
    assert str(n) in str(e.value) and "32" in str(e.value)
    with pytest.raises(PromptTooLongError):
        list(small.stream(prompt, SamplingParams(max_tokens=4)))
    with pytest.raises(PromptTooLongError):  # one bad prompt in a batch: nothing runs, nothing leaks
        small.generate(["Hi", prompt], SamplingParams(max_tokens=4))
    assert small.engine.kv.allocator.num_free == free
    # still usable
    out = _gen(small, "Hi", max_tokens=4, ignore_eos=True, **GREEDY)
    assert len(out.token_ids) == 4
    assert small.engine.kv.allocator.num_free == free


def test_context_boundary(small):
    """A prompt of max_model_len - 1 tokens gets exactly one token; max_model_len tokens is an error."""
    ids = small.tokenizer.encode("one two three four five six seven eight nine ten " * 4)[:31]
    out = small.generate(ids, SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    out = small.generate(ids[:20], SamplingParams(max_tokens=50, ignore_eos=True, **GREEDY))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    with pytest.raises(PromptTooLongError):
        small.generate(ids + ids[:1], SamplingParams(max_tokens=1))


def test_more_requests_than_the_kv_cache_holds_at_once(small_exact):
    """The small engine's cache holds two 32-token requests; five queue and all complete unchanged
    (on the exact path: a preempted request is recomputed by prefill, which rounds like the exact
    decode kernels but not like the int8 fast path's, see README)."""
    small = small_exact
    free = small.engine.kv.allocator.num_free
    prompts = [f"Count from {i} to {i + 5}:" for i in range(5)]
    params = SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY)
    outs = small.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == small.generate(p, params)[0].token_ids
    assert small.engine.kv.allocator.num_free == free


def test_abandoned_stream_returns_its_blocks(llm, free0):
    for prompt in [PROMPTS[0], MESSAGES]:
        gen = llm.stream(prompt, SamplingParams(max_tokens=64, ignore_eos=True, **GREEDY))
        for i, _chunk in enumerate(gen):
            assert llm.engine.kv.allocator.num_free < free0   # blocks are held while it runs
            if i == 3:
                break
        gen.close()
        assert llm.engine.kv.allocator.num_free == free0
    # and the engine still produces the same output as before
    a = _gen(llm, PROMPTS[0], max_tokens=8, **GREEDY)
    assert a.token_ids == _gen(llm, PROMPTS[0], max_tokens=8, **GREEDY).token_ids


def test_bad_sampling_params():
    for kw in [dict(temperature=-1), dict(max_tokens=-1), dict(top_p=0), dict(logprobs=21), dict(stop=[""])]:
        with pytest.raises(ValueError):
            SamplingParams(**kw)


@pytest.fixture(scope="module")
def scratch(llm) -> LLM:
    """An engine of its own (not leak-checked after every test) for cases that currently leak."""
    return LLM(max_model_len=64)


@pytest.mark.parametrize("bad", [[1, 2, 60000], [1, -5, 3]])
def test_out_of_vocabulary_token_ids(scratch, bad):
    free = scratch.engine.kv.allocator.num_free
    try:
        with pytest.raises((ValueError, SlipstreamError)):
            scratch.generate(bad, SamplingParams(max_tokens=4))
        assert scratch.engine.kv.allocator.num_free == free
    finally:  # keep this engine usable for the next case, whatever happened
        alloc = scratch.engine.kv.allocator
        if alloc.num_free != free:
            alloc.free([b for b in range(alloc.num_blocks) if alloc.ref_count[b] > 0])
