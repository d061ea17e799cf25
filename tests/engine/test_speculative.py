"""Speculative decoding: the n-gram proposer, lossless greedy verification on the embedded SmolLM2
(alone, batched, with stops and limits), rejection sampling that preserves the target
distribution (chi-square), and KV / prefix-cache consistency after rejected guesses."""
from __future__ import annotations

import math

import pytest
import torch
from support import engine

from slipstream import LLM, SamplingParams
from slipstream.engine.engine import Engine
from slipstream.engine.request import Request
from slipstream.engine.sampling import sampling_distribution
from slipstream.engine.speculative import NgramProposer, make_proposer, rejection_sample
from slipstream.errors import SlipstreamError

CODE = '''def compute_total(items):
    total = 0
    for item in items:
        total += item.price * item.quantity
    return total


def compute_average(items):
    if not items:
        return 0
    return compute_total(items) / len(items)
'''
ECHO = "# utils.py, version 1\n" + CODE + "\n\n# utils.py, version 2 (same code, compute_total renamed to sum_prices)\n"
PROMPTS = [ECHO, "The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8,", "Once upon a time, there was a"]


# -- the proposer ----------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(k=3, n_max=3)
    assert p.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert p.propose([7, 1, 2, 8, 1, 2, 6, 5, 1, 2], 3) == [6, 5, 1]   # the most recent occurrence
    assert p.propose([1, 2, 3, 4, 5, 6], 3) == []                       # nothing repeats
    assert p.propose([5, 6, 5], 2) == [6, 5]                            # falls back to shorter n-grams
    assert p.propose([1, 2, 3, 1, 2, 3, 1], 2) == [2, 3]                # at most k
    assert p.propose([4], 3) == []


def test_unknown_or_unavailable_methods_are_clear_errors():
    assert make_proposer(None, 4) is None
    for spec, msg in [("bogus", "unknown speculative"), ("mtp", "MTP layers")]:
        with pytest.raises(ValueError, match=msg):
            make_proposer(spec, 4)


# -- rejection sampling preserves the target distribution ------------------------------------------

def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    mask = probs > 0
    assert counts[~mask].sum() == 0, "drew a token the target gives no probability"
    exp = probs[mask] * n
    stat = float(((counts[mask] - exp) ** 2 / exp).sum())
    dof = int(mask.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square upper tail
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("with_q", [False, True], ids=["point-mass-draft", "draft-distribution"])
def test_rejection_sampling_output_follows_the_target(with_q):
    gen = torch.Generator().manual_seed(1234)
    V, n = 8, 40_000
    p = torch.softmax(torch.randn(V, generator=gen) * 1.5, 0)
    p[5] = 0.0                                 # a token the target never picks
    p /= p.sum()
    q = torch.softmax(torch.randn(V, generator=gen) * 1.5, 0)
    counts = torch.zeros(V)
    kept = 0
    for _ in range(n):
        draft = int(torch.multinomial(q, 1, generator=gen)) if with_q else 3
        tok, ok = rejection_sample(p, draft, q if with_q else None, gen)
        counts[tok] += 1
        kept += ok
    assert _chi_square_pvalue(counts, p) > 1e-3
    expected_kept = float(torch.minimum(p, q).sum()) if with_q else float(p[3])   # sum min(p, q)
    assert abs(kept / n - expected_kept) < 0.01


def test_sampling_distribution_is_the_samplers_distribution():
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    sp = SamplingParams(temperature=0.5, top_k=3)
    p = sampling_distribution(row, sp)
    assert p[3] == p[4] == 0 and torch.allclose(p[:3], torch.softmax(row[:3] / 0.5, 0))
    p = sampling_distribution(row, SamplingParams(temperature=1.0, top_p=0.6))
    assert (p > 0).sum() == 2 and math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)


# -- lossless on the real model --------------------------------------------------------------------


def run(e: Engine, prompts: list[str], params: SamplingParams) -> list[Request]:
    reqs = [Request(e.tokenizer.encode(p), params) for p in prompts]
    for _ in e.run(reqs):
        pass
    return reqs


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_is_identical_with_ngram_speculation(llm, k):
    params = SamplingParams(max_tokens=64, temperature=0)
    plain = run(engine(llm), PROMPTS, params)
    e = engine(llm, speculative="ngram", num_speculative_tokens=k, speculative_max_batch=8)
    spec = run(e, PROMPTS, params)                     # four sequences verified in the same steps
    for a, b in zip(plain, spec):
        assert b.output_ids == a.output_ids and b.text == a.text and b.finish_reason == a.finish_reason
    alone = run(e, [ECHO], params)[0]
    assert alone.output_ids == plain[0].output_ids
    s = e.stats()
    assert s.spec_accepted_tokens > 0 and s.spec_drafted_tokens >= s.spec_accepted_tokens
    assert s.spec_emitted_tokens / s.spec_verifications > 1.5 if k == 4 else True
    assert sum(s.spec_accepted_at) == s.spec_accepted_tokens and len(s.spec_accepted_at) == k
    assert s.kv_blocks_in_use == 0


def test_limits_and_stops_hold_inside_a_speculative_step(llm):
    e = engine(llm, speculative="ngram", num_speculative_tokens=6)
    base = engine(llm)
    for params in (SamplingParams(max_tokens=7, temperature=0),
                   SamplingParams(max_tokens=80, temperature=0, stop=["return total"]),
                   SamplingParams(max_tokens=80, temperature=0, logprobs=2)):
        a, b = run(base, [ECHO], params)[0], run(e, [ECHO], params)[0]
        assert (b.output_ids, b.text, b.finish_reason) == (a.output_ids, a.text, a.finish_reason)
        assert len(b.output_ids) <= params.max_tokens
        if params.logprobs:
            assert [lp.token_id for lp in b.logprobs] == b.output_ids
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
    assert e.stats().spec_verifications > 0


def test_rejected_guesses_do_not_poison_the_prefix_cache(llm):
    e = engine(llm, speculative="ngram", num_speculative_tokens=4)
    params = SamplingParams(max_tokens=48, temperature=0)
    first = run(e, [ECHO], params)[0]
    assert e.stats().spec_drafted_tokens > e.stats().spec_accepted_tokens   # some guesses were rejected
    # the same prompt again: its cached blocks (prompt and generated text) must hold the right KV
    again = run(e, [ECHO], params)[0]
    assert again.metrics.num_cached_prompt_tokens > 0
    assert again.output_ids == first.output_ids
    cont_ids = first.prompt_ids + first.output_ids
    nxt = Request(list(cont_ids), SamplingParams(max_tokens=8, temperature=0))
    for _ in e.run([nxt]):
        pass
    ref = Request(list(cont_ids), SamplingParams(max_tokens=8, temperature=0))
    for _ in engine(llm, enable_prefix_cache=False).run([ref]):
        pass
    assert nxt.metrics.num_cached_prompt_tokens > len(first.prompt_ids)
    assert nxt.output_ids == ref.output_ids


def test_seeded_sampling_draws_the_same_tokens_with_or_without_speculation(llm):
    # whether a step speculates depends on the batch, so seeded sampled requests never do
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=11)
    e = engine(llm, speculative="ngram")
    a = run(e, [ECHO], params)[0]
    assert e.stats().spec_verifications == 0
    assert a.output_ids == run(engine(llm), [ECHO], params)[0].output_ids
    unseeded = run(e, [ECHO], SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95))[0]
    assert len(unseeded.output_ids) > 0 and e.stats().spec_verifications > 0


def test_speculation_switches_off_for_large_batches(llm):
    e = engine(llm, speculative="ngram", speculative_max_batch=2)
    run(e, PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))   # 4 > 2 running
    assert e.stats().spec_verifications == 0
    run(e, PROMPTS[:2], SamplingParams(max_tokens=24, temperature=0))
    assert e.stats().spec_verifications > 0


# -- a draft model ---------------------------------------------------------------------------------

def _random_draft(folder, llm: LLM, vocab: int | None = None):
    """A tiny random Llama in an HF folder with SmolLM2's tokenizer: a draft that is usually wrong."""
    import json

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=vocab or llm.tokenizer.vocab_size, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    llm.tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": llm.tokenizer.bos_token, "eos_token": llm.tokenizer.eos_token}))
    return folder


def test_the_target_itself_as_draft_is_lossless_and_almost_always_right(llm):
    e = engine(llm, speculative="draft:smollm2-135m", num_speculative_tokens=4)
    params = SamplingParams(max_tokens=40, temperature=0)
    spec = run(e, PROMPTS[1:3], params)
    plain = run(engine(llm), PROMPTS[1:3], params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert e.stats().spec_emitted_tokens / e.stats().spec_verifications > 4.0
    sampled = run(e, PROMPTS[1:3], SamplingParams(max_tokens=24, temperature=0.9, ignore_eos=True))
    assert [len(r.output_ids) for r in sampled] == [24, 24]
    assert e.proposer.kv.allocator.num_in_use == 0 and not e.proposer.seqs   # the draft's KV is freed too
    assert e.proposer.runtime.name == "native" and e.proposer.kv.k.dtype == torch.float16   # as the target's


def test_a_poor_draft_model_changes_nothing_but_speed(llm, tmp_path):
    draft = _random_draft(tmp_path / "draft", llm)
    e = engine(llm, speculative=f"draft:{draft}", num_speculative_tokens=3)
    params = SamplingParams(max_tokens=32, temperature=0)
    spec = run(e, PROMPTS[:3], params)
    plain = run(engine(llm), PROMPTS[:3], params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    s = e.stats()
    assert s.spec_verifications > 0 and s.spec_accepted_tokens < s.spec_drafted_tokens / 2
    assert s.kv_blocks_in_use == 0 and e.proposer.kv.allocator.num_in_use == 0
    with pytest.raises(SlipstreamError, match="vocabulary"):
        engine(llm, speculative=f"draft:{_random_draft(tmp_path / 'other', llm, vocab=1000)}")


def test_bad_speculative_settings_are_errors(llm):
    with pytest.raises(SlipstreamError, match="unknown speculative"):
        engine(llm, speculative="nope")
    with pytest.raises(SlipstreamError, match="num_speculative_tokens"):
        engine(llm, speculative="ngram", num_speculative_tokens=0)
