"""Constraints compiled with llguidance on the default model's own tokenizer: the masks allow exactly
the tokens that continue a valid answer, bad constraints are refused with a reason, and masks apply
to a batch of logits."""
from __future__ import annotations

import json

import pytest
import torch

from slipstream.structured.constraint import Constraint, ConstraintError
from slipstream.structured.masks import apply_masks, fill_masks

pytest.importorskip("llguidance", reason="llguidance (structured output) is not installed")


@pytest.fixture(scope="module")
def tok():
    from support import skip_unless_default_model

    skip_unless_default_model()
    from slipstream.tokenizer import Tokenizer
    from slipstream.weights import default_model_path

    return Tokenizer.from_gguf(default_model_path())


def _matcher(tok, c: Constraint):
    from slipstream.structured.grammar import Matcher, compile_constraint

    return Matcher(compile_constraint(tok, c), tok)


def _allowed(tok, m) -> set[int]:
    logits = torch.zeros(1, tok.vocab_size)
    apply_masks(logits, fill_masks([m], tok.vocab_size))
    return set((logits[0] == 0).nonzero().flatten().tolist())


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_a_schema_allows_its_answer_token_by_token_and_then_only_eos(tok):
    m = _matcher(tok, Constraint.json_schema(SCHEMA))
    for t in tok.encode('{"name":"Ada","age":36}', add_special_tokens=False):
        assert t in _allowed(tok, m)
        assert m.accept(t)
    assert _allowed(tok, m) == set(tok.eos_token_ids)   # every EOS of the model, not one
    assert m.finished


def test_the_mask_forbids_what_breaks_the_schema(tok):
    m = _matcher(tok, Constraint.json_schema(SCHEMA))
    allowed = _allowed(tok, m)
    for bad in ("hello", " {", "[", "```"):
        assert tok.encode(bad, add_special_tokens=False)[0] not in allowed, bad
    for t in tok.encode('{"name":"Ada","age":', add_special_tokens=False):
        assert m.accept(t)
    after = _allowed(tok, m)
    assert tok.token_to_id('"') not in after          # age is an integer
    assert any(tok.decode([t]).isdigit() for t in after)


def test_properties_come_in_the_schema_order(tok):
    """The constraint keeps the schema's key order (OpenAI's strict outputs follow it)."""
    c = Constraint.json_schema({"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}},
                                "required": ["z", "a"], "additionalProperties": False})
    assert list(json.loads(c.spec)["properties"]) == ["z", "a"]
    m = _matcher(tok, c)
    assert m.valid_prefix(tok.encode('{"z":1,"a":2}', add_special_tokens=False)) > 0
    wrong_order = tok.encode('{"a":', add_special_tokens=False)
    assert m.valid_prefix(wrong_order) < len(wrong_order)


def test_choice_regex_and_gbnf_grammars(tok):
    m = _matcher(tok, Constraint.choice(["yes", "no"]))
    allowed = {tok.decode([t]) for t in _allowed(tok, m)}
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
    m = _matcher(tok, Constraint.regex("[0-9]{3}"))
    assert all(tok.decode([t]).isdigit() for t in _allowed(tok, m))
    m = _matcher(tok, Constraint.grammar('root ::= "A" ("B" | "C")'))
    ids = tok.encode("AB", add_special_tokens=False)
    assert m.valid_prefix(ids) == len(ids)


@pytest.mark.parametrize("c,code", [
    (Constraint.json_schema({"type": "strin"}), "invalid_json_schema"),
    (Constraint.json_schema({"type": "string", "pattern": "(?<=a)b"}), "invalid_json_schema"),   # look-behind
    (Constraint.grammar("root ::= ("), "invalid_grammar"),
])
def test_bad_constraints_are_refused_with_the_reason(tok, c, code):
    from slipstream.structured.grammar import compile_constraint

    with pytest.raises(ConstraintError) as e:
        compile_constraint(tok, c)
    assert e.value.code == code and str(e.value)


def test_constraints_refuse_bad_input_before_compiling():
    with pytest.raises(ConstraintError):
        Constraint.regex("([")
    with pytest.raises(ConstraintError):
        Constraint.choice([])
    with pytest.raises(ConstraintError):
        Constraint.json_schema("not a schema")   # type: ignore[arg-type]


def test_equal_constraints_merge_different_ones_do_not():
    from slipstream.engine.sampling import SamplingParams

    a = SamplingParams(temperature=0, constraint=Constraint.json_schema(SCHEMA))
    b = SamplingParams(temperature=0, constraint=Constraint.json_schema(dict(SCHEMA)))
    c = SamplingParams(temperature=0, constraint=Constraint.regex("x+"))
    assert repr(a) == repr(b) and repr(a) != repr(c)   # the engine's merge key holds repr(params)


def test_apply_masks_touches_only_the_given_rows():
    logits = torch.randn(3, 70)
    before = logits.clone()
    mask = torch.zeros(1, 3, dtype=torch.int32)
    mask[0, 0] = 0b101            # tokens 0 and 2
    mask[0, 2] = 1 << 1           # token 65
    apply_masks(logits, mask, rows=[1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = (logits[1] > float("-inf")).nonzero().flatten().tolist()
    assert kept == [0, 2, 65]
    assert torch.equal(logits[1, kept], before[1, kept])


def test_the_helper_thread_fills_the_same_masks(tok):
    """MaskJob (masks computed while a GPU runs the step) gives what filling them here gives; MaskNow
    (the CPU runtime) leaves the filling to after the step."""
    from slipstream.structured.masks import MaskJob, MaskNow

    matchers = [_matcher(tok, Constraint.json_schema(SCHEMA)), None, _matcher(tok, Constraint.choice(["ab", "c"]))]
    assert torch.equal(MaskJob(matchers, tok.vocab_size).result(), fill_masks(matchers, tok.vocab_size))
    assert torch.equal(fill_masks(matchers, tok.vocab_size)[1], torch.full((tok.vocab_size // 32,), -1,
                                                                           dtype=torch.int32))
    assert MaskNow(matchers, tok.vocab_size).result() is None


def _reference_masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Bit by bit: token t allowed where bit t%32 of word t//32 is set (past the words: forbidden)."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if t >= 32 * bitmask.shape[1] or not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN and -0.0 included)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("vocab,n_words", [(70, 3), (96, 3), (100, 3), (64, 3)])
def test_masked_copy_matches_the_bitwise_reference_for_every_row_layout(vocab, n_words):
    """Whole batch or some rows, the bitmask given per logits row or per masked row; vocabularies that
    end inside a word, on a word, and past the bitmask; the caller's logits stay untouched."""
    from slipstream.structured.masks import masked_copy

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g)
    logits[0, 5] = float("nan")
    logits[1, 7] = -0.0
    bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (4, n_words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[2] = -1
    want = _reference_masked(logits, bitmask)
    before = logits.clone()
    got = masked_copy(logits, bitmask, [0, 1, 2, 3])
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())
    assert same(got, want)
    rows = [1, 3]
    want_some = logits.clone()
    want_some[rows] = want[rows]
    assert same(masked_copy(logits, bitmask, rows), want_some)             # one bitmask row per logits row
    assert same(masked_copy(logits, bitmask[rows], rows), want_some)       # one per masked row
    in_place = logits.clone()
    apply_masks(in_place, bitmask[rows], rows)
    assert same(in_place, want_some)
    assert same(masked_copy(logits, bitmask, []), logits)
    with pytest.raises(ValueError):
        masked_copy(logits, bitmask[:3], rows)


BENCH_SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 24},
    "items": {"type": "array", "minItems": 3, "maxItems": 3,
              "items": {"type": "string", "minLength": 3, "maxLength": 24}}},
    "required": ["topic", "items"], "additionalProperties": False}
MIXED_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "ok": {"type": "boolean"}, "x": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
    "required": ["name", "age", "tags", "ok", "x"], "additionalProperties": False}
WALKS = [
    (Constraint.json_schema(BENCH_SCHEMA), '{"topic":"fruits","items":["apple","banana cake","kiwi"]}'),
    (Constraint.json_schema(MIXED_SCHEMA), '{"name":"Ada Love","age":36,"tags":["a b","cd"],"ok":true,"x":-1.5e3}'),
    (Constraint.json_object(), '{"a":[1,2,{"b":"c"}],"d":null}'),
    (Constraint.regex("[0-9]{3}-[a-z]+"), "123-abc"),
    (Constraint.choice(["yes", "no", "yesterday"]), "yesterday"),
    (Constraint.grammar('root ::= "A" ("B" | "C")+ " end"'), "ABCBB end"),
]


def _walk(tok, c: Constraint, text: str):
    """(matcher, its mask as a bool array over the vocabulary, the next answer token or None) at every
    state along the answer."""
    import numpy as np

    m = _matcher(tok, c)
    ids = tok.encode(text, add_special_tokens=False)
    for t in ids + [None]:
        words = fill_masks([m], tok.vocab_size).numpy()[0]
        yield m, np.unpackbits(words.view(np.uint8), bitorder="little")[:tok.vocab_size].astype(bool), t
        if t is not None:
            assert m.accept(t)


@pytest.mark.parametrize("c,text", WALKS, ids=[c.kind for c, _ in WALKS])
def test_surely_allows_never_claims_a_token_the_mask_forbids(tok, c, text):
    """The quick check behind constrained_logits: where it says yes, the mask agrees, for every token the
    mask forbids at every state of an answer (forced text, string contents, numbers, the end)."""
    import numpy as np

    sure_next = 0
    for m, allowed, nxt in _walk(tok, c, text):
        wrong = [t for t in np.nonzero(~allowed)[0].tolist() if m.surely_allows(t)]
        assert not wrong, [(t, tok.decode([t])) for t in wrong[:5]]
        sure_next += nxt is not None and m.surely_allows(nxt)
    if c.kind in ("json_schema", "json_object"):
        assert sure_next > 0   # the check is of use: free text answers yes


def test_constrained_logits_samples_what_the_full_masks_sample(tok):
    """Greedy rows left unmasked where their best token is surely allowed still pick the token the masked
    row picks; rows with penalties, logprobs or a temperature get exactly the masked row; a row
    without a matcher is untouched; masks given in advance give the same."""
    from slipstream.engine.sampling import Sampler, SamplingParams
    from slipstream.structured.masks import constrained_logits, masked_copy

    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2),
              SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=0)]
    g = torch.Generator().manual_seed(0)
    walks = [_walk(tok, *WALKS[i]) for i in (0, 1, 0, 2)]
    skipped = 0
    for step in range(9):
        states = [next(w, None) for w in walks]
        if any(s is None for s in states):
            break
        matchers = [m for m, _, _ in states] + [None]
        logits = torch.randn(5, tok.vocab_size, generator=g)
        for r, (_, allowed, nxt) in enumerate(states):
            if nxt is not None and step % 3:
                logits[r, nxt] += 20          # the model agrees with the grammar
            else:
                logits[r, int((~allowed).argmax())] += 20   # the model wants a forbidden token
        full = fill_masks(matchers, tok.vocab_size)
        want = masked_copy(logits, full, [0, 1, 2, 3])
        before = logits.clone()
        for masks in (None, full):
            got = constrained_logits(logits, matchers, params, tok.vocab_size, masks)
            assert torch.equal(logits, before)
            for r in (1, 2, 3):
                assert torch.equal(got[r], want[r])
            assert torch.equal(got[4], logits[4])
            assert int(got[0].argmax()) == int(want[0].argmax())
            skipped += masks is None and not torch.equal(got[0], want[0])
            if masks is None:
                outs = [Sampler()(x, params, [[1, 2]] * 5, [[3]] * 5,
                                  [torch.Generator().manual_seed(1) for _ in range(5)]) for x in (got, want)]
                assert outs[0].token_ids == outs[1].token_ids
    assert skipped > 0   # the quick path was taken


def test_matchers_of_one_grammar_are_compiled_once_and_independent(tok, monkeypatch):
    """The second request under a constraint neither checks nor compiles its grammar again (a copy of the
    first matcher at the start), and the copies move on their own."""
    import llguidance

    from slipstream.structured.grammar import Matcher, compile_constraint

    c = Constraint.json_schema({"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"],
                                "additionalProperties": False})
    grammar = compile_constraint(tok, c)
    first = Matcher(grammar, tok)
    for t in tok.encode('{"q":1', add_special_tokens=False):
        assert first.accept(t)

    class Refused:
        def __init__(self, *a, **k):
            raise AssertionError("compiled again")

        @staticmethod
        def validate_grammar(*a, **k):
            raise AssertionError("checked again")

    monkeypatch.setattr(llguidance, "LLMatcher", Refused)
    assert compile_constraint(tok, c) == grammar
    second = Matcher(grammar, tok)
    assert _allowed(tok, second) != _allowed(tok, first)
    answer = tok.encode('{"q":23}', add_special_tokens=False)
    assert second.valid_prefix(answer) == len(answer)
    for t in answer:
        assert second.accept(t)
    assert second.finished and not first.finished
    monkeypatch.undo()
    with pytest.raises(ConstraintError):   # refusals are not remembered as grammars
        compile_constraint(tok, Constraint.json_schema({"type": "strin"}))
