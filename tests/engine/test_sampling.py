"""Tests for slipstream.engine.sampling (CPU, fast, deterministic: every draw is seeded)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from slipstream.engine.sampling import (
    MAX_LOGPROBS,
    Sampler,
    SamplingParams,
    TokenLogprobs,
    apply_penalties,
    make_generator,
)
from slipstream.engine.sampling import draw as draw_index

sampler = Sampler()


def draw(logits_row: torch.Tensor, sp: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """``n`` successive draws for one request from a fixed logits row."""
    g = make_generator(seed)
    logits = logits_row.unsqueeze(0)
    return [sampler(logits, [sp], [[]], [[]], [g]).token_ids[0] for _ in range(n)]


def assert_matches(samples: list[int], expected: dict[int, float]) -> None:
    """Support inside ``expected`` and a chi-square statistic well below a loose bound."""
    counts = Counter(samples)
    outside = set(counts) - set(expected)
    assert not outside, f"sampled outside the allowed set: {outside}"
    n = len(samples)
    chi2 = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in expected.items())
    df = max(1, len(expected) - 1)
    # Mean of chi2 is df and its std sqrt(2 df); 6 std above is far beyond chance but
    # catches a wrong distribution at these sample sizes.
    assert chi2 < df + 6 * math.sqrt(2 * df), f"chi2={chi2:.1f} df={df} counts={counts}"


def truncated(probs: torch.Tensor, allowed: list[int]) -> dict[int, float]:
    mass = float(probs[allowed].sum())
    return {t: float(probs[t]) / mass for t in allowed}


# ----------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    res = sampler(logits, params, [[]] * 6, [[]] * 6, [None] * 6)
    assert res.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert res.logprobs == [None] * 6


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0]])
    res = sampler(logits, [SamplingParams(temperature=0.0)], [[]], [[]], [None])
    assert res.token_ids == [1] == torch.argmax(logits, dim=-1).tolist()


def test_greedy_rows_mixed_with_random_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, top_k=5),
    ]
    prompts = [[1, 2], [3], [int(logits[2].argmax()), 7], []]
    outs = [[4], [], [9, 9], [1]]
    gens = [None, make_generator(3), None, make_generator(4)]
    before = logits.clone()
    res = sampler(logits, params, prompts, outs, gens)
    assert torch.equal(logits, before), "sampler must not modify the caller's logits"
    assert res.token_ids[0] == int(logits[0].argmax())
    pen = apply_penalties(logits[2].clone(), params[2], prompts[2], outs[2])
    assert res.token_ids[2] == int(pen.argmax())


def test_top_k_one_is_argmax() -> None:
    logits = torch.tensor([0.3, 2.0, 2.0, -1.0])
    assert set(draw(logits, SamplingParams(top_k=1), 20)) == {1}


# -------------------------------------------------------------------------- penalties


def test_repetition_penalty_hand_computed() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, 0.0])
    sp = SamplingParams(repetition_penalty=2.0)
    # seen: 0 (prompt), 1 (output, twice), 5 (prompt, logit 0 stays 0); 2, 3, 4 unseen.
    out = apply_penalties(logits.clone(), sp, prompt_ids=[0, 5], output_ids=[1, 1])
    assert torch.allclose(out, torch.tensor([1.0, -2.0, 0.5, -3.0, 1.0, 0.0]))


def test_presence_and_frequency_penalties_hand_computed() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0])
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Only output tokens count: 2 appears 3 times, 4 once; prompt token 0 is untouched.
    out = apply_penalties(logits.clone(), sp, prompt_ids=[0, 0], output_ids=[2, 4, 2, 2])
    expected = torch.tensor([2.0, -1.0, 0.5 - 0.5 - 3 * 0.25, -3.0, 1.0 - 0.5 - 0.25])
    assert torch.allclose(out, expected)


def test_negative_presence_penalty_encourages() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0])
    out = apply_penalties(logits.clone(), SamplingParams(presence_penalty=-1.0), [], [1, 1])
    assert torch.allclose(out, torch.tensor([1.0, 2.0, 1.0]))


def test_penalties_combined_repetition_first() -> None:
    logits = torch.tensor([4.0, -2.0, 1.0])
    sp = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    out = apply_penalties(logits.clone(), sp, prompt_ids=[1], output_ids=[0, 0])
    # token 0: 4/2 = 2, then - (1.0 + 2*0.5) = 0; token 1: -2*2 = -4 (prompt only: no presence).
    assert torch.allclose(out, torch.tensor([0.0, -4.0, 1.0]))


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    sp = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sampler(logits, [sp], [[0]], [[]], [None]).token_ids == [1]
    sp = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert sampler(logits, [sp], [[0]], [[]], [None]).token_ids == [0]  # prompt not counted
    assert sampler(logits, [sp], [[]], [[0]], [None]).token_ids == [1]


# ------------------------------------------------------------------------ truncation

# Probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (sorted, with ids shuffled).
_PROBS = torch.tensor([0.1, 0.4, 0.04, 0.25, 0.06, 0.15])
_LOGITS = _PROBS.log()


def test_no_truncation_matches_softmax() -> None:
    samples = draw(_LOGITS, SamplingParams(), 3000, seed=11)
    assert_matches(samples, {t: float(p) for t, p in enumerate(_PROBS)})


def test_temperature_matches_scaled_softmax() -> None:
    probs = torch.softmax(_LOGITS / 0.5, dim=-1)
    samples = draw(_LOGITS, SamplingParams(temperature=0.5), 3000, seed=12)
    assert_matches(samples, {t: float(p) for t, p in enumerate(probs)})


def test_top_k() -> None:
    samples = draw(_LOGITS, SamplingParams(top_k=3), 3000, seed=13)
    assert_matches(samples, truncated(_PROBS, [1, 3, 5]))


@pytest.mark.parametrize("top_k", [0, -1, 6, 100])
def test_top_k_off(top_k: int) -> None:
    samples = draw(_LOGITS, SamplingParams(top_k=top_k), 2000, seed=14)
    assert set(samples) == set(range(6))


def test_top_p() -> None:
    # Cumulative 0.4, 0.65, 0.8, ...: top_p=0.7 needs the three largest.
    samples = draw(_LOGITS, SamplingParams(top_p=0.7), 3000, seed=15)
    assert_matches(samples, truncated(_PROBS, [1, 3, 5]))


def test_top_p_always_keeps_one() -> None:
    assert set(draw(_LOGITS, SamplingParams(top_p=1e-6), 50, seed=16)) == {1}


def test_top_p_after_top_k_uses_renormalised_mass() -> None:
    # top_k=2 leaves 0.4/0.65 and 0.25/0.65 (0.615, 0.385): top_p=0.6 keeps only the first.
    assert set(draw(_LOGITS, SamplingParams(top_k=2, top_p=0.6), 100, seed=17)) == {1}
    samples = draw(_LOGITS, SamplingParams(top_k=2, top_p=0.7), 2000, seed=17)
    assert_matches(samples, truncated(_PROBS, [1, 3]))


def test_top_p_large_vocab_grows_candidates() -> None:
    # A flat-ish vocabulary of 5000: the nucleus needs far more than the first top-k guess.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5000, generator=gen) * 0.3
    probs = torch.softmax(logits, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_p, 0) - sorted_p
    allowed = set(order[before < 0.9].tolist())
    assert len(allowed) > 1000
    samples = draw(logits, SamplingParams(top_p=0.9), 400, seed=18)
    assert set(samples) <= allowed
    # And the tail of the nucleus is reachable, not cut at the first candidate guess.
    rank = {t: r for r, t in enumerate(order.tolist())}
    assert max(rank[t] for t in samples) >= 256


def test_min_p() -> None:
    # max prob 0.4: min_p=0.3 keeps probs >= 0.12 -> ids 1, 3, 5.
    samples = draw(_LOGITS, SamplingParams(min_p=0.3), 3000, seed=19)
    assert_matches(samples, truncated(_PROBS, [1, 3, 5]))


def test_min_p_with_temperature_is_relative_to_scaled_max() -> None:
    probs = torch.softmax(_LOGITS / 2.0, dim=-1)  # flatter: sqrt of the ratios
    allowed = [t for t in range(6) if probs[t] >= 0.5 * probs.max()]
    assert allowed == [0, 1, 3, 5]
    samples = draw(_LOGITS, SamplingParams(temperature=2.0, min_p=0.5), 3000, seed=20)
    assert_matches(samples, truncated(probs, allowed))


def test_top_k_top_p_min_p_combined_stay_in_set() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2000, generator=gen) * 2
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.8, min_p=0.05)
    # Reference: the same pipeline written the slow, obvious way over the whole vocab.
    scaled = logits / 0.8
    keep = torch.zeros(2000, dtype=torch.bool)
    keep[torch.topk(scaled, 50).indices] = True
    p = torch.softmax(scaled.masked_fill(~keep, -math.inf), dim=-1)
    sp_sorted, order = torch.sort(p, descending=True)
    nucleus = torch.zeros(2000, dtype=torch.bool)
    nucleus[order[(torch.cumsum(sp_sorted, 0) - sp_sorted) < 0.8]] = True
    keep &= nucleus
    keep &= p >= 0.05 * p.max()
    allowed = keep.nonzero().flatten().tolist()
    assert 1 < len(allowed) < 50
    samples = draw(logits, sp, 3000, seed=21)
    assert_matches(samples, truncated(p, allowed))


@pytest.mark.parametrize("n", [7, 2048, 20_000, 151_936])
def test_draw_matches_weights_and_skips_zeros(n: int) -> None:
    # Mass on a handful of ids spread across the vector (so across the large-vector
    # blocks), a thin tail everywhere else, and explicit zeros that must never come up.
    gen = torch.Generator().manual_seed(n)
    weights = torch.full((n,), 1e-9)
    heavy = torch.randperm(n, generator=gen)[:5].tolist()
    for t, w in zip(heavy, [0.4, 0.25, 0.15, 0.1, 0.1]):
        weights[t] = w
    zeros = [t for t in range(0, n, 3) if t not in heavy]
    weights[zeros] = 0.0
    tail = float(weights.sum()) - 1.0
    g = make_generator(1)
    samples = [draw_index(weights, g) for _ in range(2000)]
    assert not set(samples) & set(zeros)
    # Conditioned on landing on a heavy id, draws follow the heavy weights (they sum to 1).
    assert_matches([t for t in samples if t in heavy], {t: float(weights[t]) for t in heavy})
    # The thin tail (total mass ~1e-4 at most) gets about its share: a hit or two at most.
    assert sum(t not in heavy for t in samples) <= 3 + 2000 * 10 * tail


@pytest.mark.parametrize("n", [5, 5000])
@pytest.mark.parametrize("pos", ["first", "last"])
def test_draw_single_positive_weight(n: int, pos: str) -> None:
    weights = torch.zeros(n)
    t = 0 if pos == "first" else n - 1
    weights[t] = 0.3
    g = make_generator(2)
    assert {draw_index(weights, g) for _ in range(50)} == {t}


# ------------------------------------------------------------------ seeds and batches


def test_same_seed_same_tokens_different_seed_differs() -> None:
    flat = torch.zeros(1000)
    a = draw(flat, SamplingParams(seed=5), 30, seed=5)
    b = draw(flat, SamplingParams(seed=5), 30, seed=5)
    c = draw(flat, SamplingParams(seed=6), 30, seed=6)
    assert a == b
    assert a != c


def test_make_generator() -> None:
    assert make_generator(None) is None
    g1, g2 = make_generator(42), make_generator(42)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(seed=7),
        SamplingParams(seed=7, top_k=20, temperature=0.7),
        SamplingParams(seed=7, top_p=0.9, min_p=0.01, repetition_penalty=1.2),
    ],
)
def test_seeded_row_is_batch_independent(sp: SamplingParams) -> None:
    vocab, steps = 500, 12
    gen = torch.Generator().manual_seed(3)
    step_logits = [torch.randn(4, vocab, generator=gen) for _ in range(steps)]
    prompt = [1, 2, 3]

    # Alone: the request is row 0 of a batch of one.
    g = make_generator(sp.seed)
    alone, out = [], []
    for lg in step_logits:
        t = sampler(lg[:1], [sp], [prompt], [out], [g]).token_ids[0]
        alone.append(t)
        out = out + [t]

    # In a batch: the same logits at row 2, beside a greedy row, another seeded row and
    # an unseeded row (which uses the global RNG).
    others = [SamplingParams(temperature=0.0), SamplingParams(seed=99), SamplingParams(top_k=3)]
    g = make_generator(sp.seed)
    gens = [None, make_generator(99), g, None]
    params = [others[0], others[1], sp, others[2]]
    batched, out = [], []
    other_out: list[list[int]] = [[], [], [], []]
    for lg in step_logits:
        batch = torch.stack([lg[1], lg[2], lg[0], lg[3]])
        outs = [other_out[0], other_out[1], out, other_out[3]]
        res = sampler(batch, params, [[5], [6], prompt, [7]], outs, gens)
        t = res.token_ids[2]
        batched.append(t)
        out = out + [t]
        for i in (0, 1, 3):
            other_out[i] = other_out[i] + [res.token_ids[i]]
    assert alone == batched


# --------------------------------------------------------------------------- logprobs


def test_logprobs_match_log_softmax_of_penalised_logits() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 64)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.3, top_k=4, seed=1, logprobs=3, repetition_penalty=1.5),
        SamplingParams(logprobs=None),
    ]
    prompts, outs = [[], [0, 1, 2], []], [[], [3], []]
    res = sampler(logits, params, prompts, outs, [None, make_generator(1), None])
    assert res.logprobs[2] is None

    for row in (0, 1):
        lp = res.logprobs[row]
        assert isinstance(lp, TokenLogprobs)
        pen = apply_penalties(logits[row].clone(), params[row], prompts[row], outs[row])
        # Before temperature and truncation: the log-softmax of the penalised logits.
        ref = torch.log_softmax(pen, dim=-1)
        assert lp.token_id == res.token_ids[row]
        assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-5)
        k = params[row].logprobs
        assert len(lp.top) == k
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        ref_top = torch.topk(ref, k)
        assert [t for t, _ in lp.top] == ref_top.indices.tolist()
        assert vals == pytest.approx(ref_top.values.tolist(), abs=1e-5)
        for t, v in lp.top:
            assert v == pytest.approx(float(ref[t]), abs=1e-5)
    # Greedy: the chosen token is the best alternative.
    assert res.logprobs[0].top[0][0] == res.token_ids[0]


def test_logprobs_zero_gives_only_sampled_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    res = sampler(logits, [SamplingParams(temperature=0.0, logprobs=0)], [[]], [[]], [None])
    lp = res.logprobs[0]
    assert lp is not None and lp.top == [] and lp.token_id == 2
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": -1},
        {"max_tokens": 1.5},
        {"max_tokens": True},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -2},
        {"top_p": 0.0},
        {"top_p": 1.1},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"presence_penalty": 2.5},
        {"presence_penalty": -2.1},
        {"frequency_penalty": 3.0},
        {"frequency_penalty": -2.5},
        {"logprobs": -1},
        {"logprobs": MAX_LOGPROBS + 1},
        {"seed": "abc"},
        {"stop": [""]},
        {"stop": [1]},
        {"stop_token_ids": [-1]},
    ],
)
def test_validation_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_valid_params_and_normalisation() -> None:
    sp = SamplingParams()
    assert sp.stop == [] and sp.stop_token_ids == [] and not sp.greedy
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).greedy
    for kwargs in (
        {"max_tokens": 0},
        {"top_k": -1},
        {"top_p": 1.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"seed": 0},
    ):
        SamplingParams(**kwargs)


def test_sampler_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 4), [SamplingParams()], [[]], [[]], [None])
    with pytest.raises(ValueError):
        sampler(torch.zeros(4), [SamplingParams()], [[]], [[]], [None])
