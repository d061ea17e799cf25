"""The prefill pacer sizes prompt work so that a decoding step stays within `factor` decode steps."""
from __future__ import annotations

import pytest

from slipstream.engine.prefill_pacer import PrefillPacer


def simulate(pacer: PrefillPacer, decode_s: float, per_token_s: float, steps: int) -> list[float]:
    """Alternate decode-only and mixed steps on a machine with the given costs; the mixed steps' times."""
    times = []
    for i in range(steps):
        if i % 3 == 0:
            pacer.observe(True, 0, decode_s)
        else:
            n = pacer.budget()
            t = decode_s + n * per_token_s
            pacer.observe(True, n, t)
            times.append(t)
    return times


def test_budget_converges_to_the_factor():
    pacer = PrefillPacer(factor=2.5, initial=64)
    times = simulate(pacer, decode_s=0.010, per_token_s=0.002, steps=30)
    assert times[0] == pytest.approx(0.010 + 64 * 0.002)      # before anything was measured: the initial budget
    assert pacer.budget() == 7                                  # 1.5 * 10 ms / 2 ms per token
    assert max(times[-10:]) <= 2.5 * 0.010 + 1e-9


def test_budget_follows_a_slower_machine_and_more_streams():
    pacer = PrefillPacer(factor=3.0)
    simulate(pacer, 0.010, 0.002, 30)
    fast = pacer.budget()
    simulate(pacer, 0.010, 0.008, 60)      # a busy neighbour: prompt tokens cost 4x
    assert pacer.budget() < fast
    simulate(pacer, 0.040, 0.008, 60)      # eight streams: a decode step takes 4x as long
    assert pacer.budget() in (9, 10)       # 2 * 40 ms / 8 ms (running averages, rounded down)


def test_floor_ceiling_and_prefill_only_steps():
    pacer = PrefillPacer(factor=2.0, floor=2, ceiling=32)
    simulate(pacer, 0.001, 0.010, 30)        # prompt tokens far dearer than a decode step: still progress
    assert pacer.budget() == 2
    pacer.observe(False, 512, 5.0)            # prefill-only steps do not count
    assert pacer.budget() == 2
    simulate(pacer, 0.100, 0.0001, 60)
    assert pacer.budget() == 32


@pytest.mark.parametrize("bad", [dict(factor=1.0), dict(floor=0), dict(floor=9, ceiling=8)])
def test_bad_settings(bad):
    with pytest.raises(ValueError):
        PrefillPacer(**bad)


def test_the_engine_paces_prompt_work_beside_a_stream():
    """Through the engine: with pacing on, a step that decodes gets fewer prompt tokens than the first
    guess once steps have been measured (64 prompt rows cost far more than 2x a one-row decode step on
    any machine), and the running stream still gets a token every step."""
    from support import engine, skip_unless_default_model
    skip_unless_default_model()
    from test_engine import PROMPTS, SYSTEM, greedy, ids

    from slipstream import LLM
    from slipstream.engine.request import Request
    llm = LLM(kv_cache_tokens=4096)
    e = engine(llm, prefill_chunk=512, prefill_budget=64, prefill_pacing=2.0)
    assert e.pacer is not None and e.pacer.budget() == 64
    first = Request(ids(llm, PROMPTS[0]), greedy(400, ignore_eos=True))
    e.add_request(first)
    for _ in range(4):                       # decode-only steps: the pacer learns what a step costs
        e.step()
    prompts = [Request(ids(llm, SYSTEM + f"Question {i}: explain undefined behaviour."), greedy(2)) for i in range(3)]
    for r in prompts:
        e.add_request(r)
    budgets = []
    while not all(r.output_ids for r in prompts):
        produced = len(first.output_ids)
        e.step()
        budgets.append(e.scheduler.prefill_budget)
        assert len(first.output_ids) == produced + 1, "the running stream waited behind the prefill"
    assert budgets[0] == 64 and min(budgets) < 64
    assert e.pacer.decode_s is not None and e.pacer.per_token_s is not None
