"""Constraints compiled for a tokenizer, and the per-request matcher that tracks generated tokens.

The token masks come from llguidance (chosen over xgrammar by measurement on SmolLM2's 49k
vocabulary, benchmarks/grammar_masks.py: a new JSON schema compiles in 0.8 ms against xgrammar's
280 ms, masks take ~20 us per token, and it needs no transformers or torch at run time). The library is
imported lazily: the engine runs without it until a request asks for structured output.

    grammar = compile_constraint(tokenizer, Constraint.json_schema({...}))   # ConstraintError if bad
    m = Matcher(grammar, tokenizer, vocab)
    m.fill(bitmask_row); m.accept(token); m.finished
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from slipstream.structured.constraint import Constraint, ConstraintError

# JSON is generated compactly ("," and ":" with no whitespace around them): a small model cannot
# pad its answer with endless blank lines, and the text is what a client would write anyway.
_JSON_OPTIONS = {"whitespace_flexible": False}

_lock = threading.Lock()
_tokenizers: dict[tuple[int, int], tuple[Any, Any]] = {}   # (id(tokenizer), vocab) -> (tokenizer, LLTokenizer)
CACHED = 64   # checked grammars and compiled matchers kept, the most recently used
_grammars: OrderedDict[tuple[int, Constraint], tuple[Any, str]] = OrderedDict()   # -> (LLTokenizer, grammar)
_matchers: OrderedDict[tuple[int, str], tuple[Any, Any]] = OrderedDict()   # -> (LLTokenizer, LLMatcher at start)


def available() -> str | None:
    """None when structured output can run here, else why not."""
    try:
        import llguidance  # noqa: F401
    except ImportError as e:   # pragma: no cover - a dependency
        return f"llguidance is not installed ({e})"
    return None


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "_eos_id", None)
    if isinstance(eos, int):
        return eos
    ids = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    if not ids:
        raise ConstraintError("structured output needs a tokenizer with an end-of-sequence token",
                              "unsupported_parameter")
    return ids[0]


def ll_tokenizer(tokenizer: Any, vocab: int | None = None) -> Any:
    """The llguidance view of a slipstream Tokenizer (built once per tokenizer and vocabulary width)."""
    import llguidance

    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise ConstraintError("structured output is not available for this model's tokenizer",
                              "unsupported_parameter")
    n_vocab = max(int(tokenizer.vocab_size), int(vocab or 0))
    key = (id(tokenizer), n_vocab)
    with _lock:
        hit = _tokenizers.get(key)
        if hit is None or hit[0] is not tokenizer:
            hit = (tokenizer, llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=_eos_id(tokenizer)))
            _tokenizers[key] = hit
        return hit[1]


def _lark_string(s: str) -> str:
    return json.dumps(s)   # JSON string escapes are Lark's


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    if c.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(c.spec, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choice":
        options = json.loads(c.spec)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(o) for o in options))
    if c.kind == "grammar":
        try:
            lark = any_to_lark(c.spec)   # GBNF (llama.cpp) is translated; Lark passes through
        except Exception as e:   # the translator's own parse errors
            raise ConstraintError(f"could not read the grammar: {str(e)[:300]}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise ConstraintError(f"unknown constraint kind {c.kind!r}")


def compile_constraint(tokenizer: Any, c: Constraint, vocab: int | None = None) -> str:
    """The checked grammar text of `c` for `tokenizer`; raises ConstraintError with the library's reason.
    Remembered (the last CACHED constraints per tokenizer): the server checks a request's constraint
    when it arrives and the engine asks again when it adds the request."""
    import llguidance

    lt = ll_tokenizer(tokenizer, vocab)
    key = (id(lt), c)
    with _lock:
        hit = _grammars.get(key)
        if hit is not None and hit[0] is lt:
            _grammars.move_to_end(key)
            return hit[1]
    try:
        text = grammar_text(c)
    except ValueError as e:
        raise ConstraintError(str(e)[:500], _code(c)) from None
    err = llguidance.LLMatcher.validate_grammar(text, lt)
    if err:
        what = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice list"}.get(c.kind, "grammar")
        raise ConstraintError(f"unsupported or invalid {what}: {err.strip()[:500]}", _code(c))
    _remember(_grammars, key, (lt, text))
    return text


def _remember(cache: OrderedDict, key: Any, value: Any) -> None:
    with _lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > CACHED:
            cache.popitem(last=False)


def _fresh_matcher(lt: Any, grammar: str) -> Any:
    """A new LLMatcher of `grammar` at its start: a copy of one built before (~1 us) where there is one,
    else built now (the grammar compiled: ~0.4 ms for a JSON schema)."""
    import llguidance

    key = (id(lt), grammar)
    with _lock:
        hit = _matchers.get(key)
        if hit is not None and hit[0] is lt:
            _matchers.move_to_end(key)
            return hit[1].deep_copy()
    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    if not m.is_error():
        _remember(_matchers, key, (lt, m.deep_copy()))
    return m


def _code(c: Constraint) -> str:
    return "invalid_json_schema" if c.kind in ("json_schema", "json_object") else "invalid_grammar"


class Matcher:
    """One request's position in its grammar: fills the allowed-token bitmask, follows sampled tokens."""

    def __init__(self, grammar: str, tokenizer: Any, vocab: int | None = None):
        self._m = _fresh_matcher(ll_tokenizer(tokenizer, vocab), grammar)
        if self._m.is_error():
            raise ConstraintError(self._m.get_error()[:500])
        self._eos = _eos_id(tokenizer)
        self._other_eos = sorted(set(getattr(tokenizer, "eos_token_ids", ()) or ()) - {self._eos})

    def fill(self, row: torch.Tensor | np.ndarray) -> None:
        """Write the allowed next tokens into `row` (a contiguous int32 row of words, bit t%32 of word
        t//32; numpy or torch). Every end-of-sequence token is allowed where the grammar allows its own one."""
        words = row.numpy() if isinstance(row, torch.Tensor) else row
        if words.dtype != np.int32 or not words.flags.c_contiguous:
            raise ValueError("a bitmask row is a contiguous int32 array")
        if not self._m.is_error():
            self._m.unsafe_compute_mask_ptr(words.ctypes.data, words.size * 4)
        self._settle(words)

    def _settle(self, words: np.ndarray) -> None:
        """After the library wrote the row: the end-of-sequence tokens, and a matcher in error."""
        eos = self._eos
        if self._m.is_error():   # cannot happen with masked sampling; end the sequence rather than fail
            words[:] = 0
            words[eos >> 5] = _bit(eos & 31)
            return
        if self._other_eos and int(words[eos >> 5]) >> (eos & 31) & 1:
            for t in self._other_eos:
                if (t >> 5) < words.size:
                    words[t >> 5] |= _bit(t & 31)

    def accept(self, token: int) -> bool:
        """Follow a sampled token; False if the grammar forbids it (the matcher is then in error)."""
        if token != self._eos and token in self._other_eos:
            token = self._eos
        return bool(self._m.consume_token(token))

    def surely_allows(self, token: int) -> bool:
        """True only where `fill` would allow `token` next; False where that is not known without the
        mask. One token through the grammar (the state unchanged) takes ~1 us where a mask takes 20 to
        500 us. The library's mask is stricter than its token check in two places, both answered False
        here: where the grammar forces text next (the mask then allows only its canonical tokens,
        the check any tokenization of it), and end-of-sequence tokens (the mask allows them where
        the grammar is complete, the check refuses them once it has stopped)."""
        if token == self._eos or token in self._other_eos or self._m.is_error():
            return False
        if self._m.compute_ff_bytes():
            return False
        return self._m.validate_tokens([token]) == 1

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from here (the state is unchanged)."""
        return int(self._m.validate_tokens(tokens)) if tokens else 0

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (not even further text)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


def _bit(b: int) -> int:
    """Bit b of an int32 word as a Python int that fits a signed int32."""
    return -(1 << 31) if b == 31 else 1 << b

