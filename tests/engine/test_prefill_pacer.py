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
    assert pacer.budget() == 64                                 # nothing measured: the initial budget
    times = simulate(pacer, decode_s=0.010, per_token_s=0.002, steps=30)
    assert times[0] == pytest.approx(0.010 + 4 * 0.002)       # decode cost known, a prompt token's not: the probe
    assert pacer.budget() == 7                                  # 1.5 * 10 ms / 2 ms per token
    assert max(times[-10:]) <= 2.5 * 0.010 + 1e-9


def test_budget_follows_a_slower_machine_and_more_streams():
    pacer = PrefillPacer(factor=3.0)
    simulate(pacer, 0.010, 0.002, 30)
    fast = pacer.budget()
    simulate(pacer, 0.010, 0.008, 60)      # a busy neighbour: prompt tokens cost 4x
    assert pacer.budget() < fast
    simulate(pacer, 0.040, 0.008, 60)      # eight streams: a decode step takes 4x as long
    assert pacer.budget() == 10            # 2 * 40 ms / 8 ms, once the window holds only the new costs


def test_floor_ceiling_and_prefill_only_steps():
    pacer = PrefillPacer(factor=2.0, floor=2, ceiling=32)
    simulate(pacer, 0.001, 0.010, 30)        # prompt tokens far dearer than a decode step: still progress
    assert pacer.budget() == 2
    pacer.observe(False, 512, 5.0)            # prefill-only steps do not count
    assert pacer.budget() == 2
    simulate(pacer, 0.100, 0.0001, 60)
    assert pacer.budget() == 32


def test_a_few_slow_decode_steps_do_not_move_the_baseline():
    """Measured in `serve`: the decode-only steps right before a burst are slowed by the burst's own
    arrival (HTTP parsing, admission). The baseline is what the stream's steps take, not those."""
    pacer = PrefillPacer(factor=2.0)
    for _ in range(30):
        pacer.observe(True, 0, 0.008)
    for slow in (0.013, 0.013, 0.010, 0.017):
        pacer.observe(True, 0, slow)
    assert pacer.decode_s == pytest.approx(0.008)
    pacer.observe(True, 4, 0.008 + 4 * 0.002)
    assert pacer.budget() == 4                         # 1 * 8 ms / 2 ms


def test_one_noisy_step_does_not_swing_the_budget():
    """Each step's extra time is weighed by its tokens: one slow one-token step (a neighbour's time
    slice) shifts the per-token estimate by a fraction, not to 20x."""
    pacer = PrefillPacer(factor=2.0, window=16)
    simulate(pacer, 0.010, 0.001, 48)                  # 10 tokens per step, 20 ms steps
    assert pacer.budget() == 10
    pacer.observe(True, 1, 0.050)                      # one step 40 ms slower than its token explains
    assert 3 <= pacer.budget() < 10
    for _ in range(16):                                # the window forgets it
        n = pacer.budget()
        pacer.observe(True, n, 0.010 + n * 0.001)
    assert pacer.budget() == 10


@pytest.mark.parametrize("bad", [dict(factor=1.0), dict(floor=0), dict(floor=9, ceiling=8), dict(window=0)])
def test_bad_settings(bad):
    with pytest.raises(ValueError):
        PrefillPacer(**bad)


def test_the_engine_paces_prompt_work_beside_a_stream():
    """Through the engine: with pacing on, the first step that decodes beside a prompt carries a small
    probe instead of the 64-token first guess, later ones stay under it (64 prompt rows cost far more
    than 2x a one-row decode step on any machine), and the running stream gets a token every step."""
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
    for _ in range(16):                      # decode-only steps: the pacer learns what a step costs (the
        e.step()                             # median of its 16-step window, so a few slow ones on a busy
                                             # machine do not set it)
    prompts = [Request(ids(llm, SYSTEM + f"Question {i}: explain undefined behaviour."), greedy(2)) for i in range(3)]
    for r in prompts:
        e.add_request(r)
    budgets = []
    assert e.pacer.decode_s is not None and e.pacer.per_token_s is None
    while not all(r.output_ids for r in prompts):
        produced = len(first.output_ids)
        e.step()
        budgets.append(e.scheduler.prefill_budget)
        assert len(first.output_ids) == produced + 1, "the running stream waited behind the prefill"
    assert budgets[0] == e.pacer.probe                  # decode cost measured, prompt cost not yet: a small probe
    assert e.pacer.per_token_s is not None and max(budgets) < 64
