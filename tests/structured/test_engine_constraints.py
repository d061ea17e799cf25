"""Constrained decoding inside the engine (the default model, exact CPU path): speculative guesses the
grammar forbids are rejected and the output is token for token the output without speculation, with
n-gram guesses and with guesses that are always wrong; a seeded sampled request gives the same
valid answer alone and beside other requests."""
from __future__ import annotations

import json

import pytest

from slipstream.structured.constraint import Constraint

pytest.importorskip("llguidance", reason="llguidance (structured output) is not installed")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": 'Repeat exactly: {"name":"Ada","age":36}'}]


@pytest.fixture(scope="module")
def llm():
    from support import skip_unless_default_model

    skip_unless_default_model()
    from slipstream import LLM

    return LLM(exact=True, speculative="ngram", num_speculative_tokens=4)


class WrongGuesses:
    """A proposer whose guesses are tokens no JSON answer can hold at that point."""

    name, k = "wrong", 3

    def __init__(self, bad: list[int]):
        self.bad = bad

    def propose_batch(self, reqs, ks):
        return [self.bad[:k] for k in ks], [None] * len(reqs)

    def verified(self, r) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


def _run(llm, params):
    return llm.chat(ASK, params)[0]


def test_speculation_under_a_grammar_is_lossless(llm, monkeypatch):
    from slipstream import SamplingParams
    from slipstream.structured.grammar import Matcher

    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0, constraint=Constraint.json_schema(SCHEMA))
    ngram = engine.proposer
    drafted = engine.spec.drafted
    with_ngram = _run(llm, params)
    assert engine.spec.drafted > drafted, "n-gram speculation never ran"
    engine.proposer = None
    try:
        plain = _run(llm, params)
        # guesses the grammar forbids, verified anyway (the pre-verification trim switched off)
        engine.proposer = WrongGuesses(llm.tokenizer.encode(" zzz qqq", add_special_tokens=False))
        monkeypatch.setattr(Matcher, "valid_prefix", lambda self, toks: len(toks))
        accepted, drafted = engine.spec.accepted, engine.spec.drafted
        wrong = _run(llm, params)
        assert engine.spec.drafted > drafted and engine.spec.accepted == accepted   # every guess rejected
    finally:
        engine.proposer = ngram
    assert with_ngram.token_ids == plain.token_ids == wrong.token_ids
    assert json.loads(plain.text)["age"] >= 0 and with_ngram.finish_reason == "stop"


def test_a_seeded_constrained_request_ignores_its_neighbours(llm):
    from slipstream import SamplingParams

    c = Constraint.json_schema(SCHEMA)
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=11, constraint=c)
    alone = llm.chat(ASK, seeded)[0]
    others = SamplingParams(max_tokens=40, temperature=1.0, constraint=Constraint.regex("[a-z ]{1,30}"))
    from slipstream.engine.request import Request

    prompt = llm.chat_prompt(ASK)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    reqs = [Request(list(ids), seeded), Request(list(ids), others), Request(list(ids), others)]
    for _ in llm.engine.run(reqs):
        pass
    assert reqs[0].output_ids == alone.token_ids
    json.loads(reqs[0].text)
    assert all(ch.isalpha() or ch == " " for r in reqs[1:] for ch in r.text)
