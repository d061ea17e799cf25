"""The per-step prefill budget (issue 19's fairness): a step that also decodes computes at most
`prefill_budget` prompt tokens, so a running stream gets a token every step while a long prompt
(or a burst of them) is prefilled; a step with nothing to decode still takes whole `prefill_chunk`s."""
from support import engine
from test_engine import PROMPTS, SYSTEM, alone, assert_idle, drain, greedy, ids

from slipstream.engine.request import Request


def test_a_step_that_decodes_prefills_at_most_the_budget(llm):
    e = engine(llm, prefill_chunk=512, prefill_budget=32)
    short = Request(ids(llm, PROMPTS[0]), greedy(60, ignore_eos=True))
    e.add_request(short)
    e.step()                                             # short alone: prefilled, decoding from now on
    long_ids = ids(llm, SYSTEM + "Explain undefined behaviour.")
    assert len(long_ids) > 2 * 32
    long = Request(long_ids, greedy(4))
    e.add_request(long)
    chunks = []
    while long.kv is None or long.kv.num_tokens < len(long_ids):
        before = long.kv.num_tokens if long.kv is not None else 0
        produced = len(short.output_ids)
        e.step()
        chunks.append(long.kv.num_tokens - before)
        assert len(short.output_ids) == produced + 1, "the running stream waited behind the prefill"
    assert max(chunks) <= 32 and len(chunks) >= len(long_ids) // 32
    drain(e, [short, long])
    assert long.output_ids == alone(llm, long_ids, greedy(4))
    assert_idle(e)


def test_with_nothing_decoding_a_prompt_takes_whole_chunks(llm):
    e = engine(llm, prefill_chunk=512, prefill_budget=32)
    long_ids = ids(llm, SYSTEM + "Explain undefined behaviour.")
    long = Request(long_ids, greedy(2))
    e.add_request(long)
    e.step()
    assert long.kv.num_tokens == len(long_ids)           # one step: the budget binds only while decoding
    drain(e, [long])
    assert_idle(e)
