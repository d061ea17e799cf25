"""Helpers shared by tests in every folder (a uniquely named module: every conftest.py is
imported as `conftest`, so `from conftest import ...` depends on collection order)."""
from __future__ import annotations

import pytest

from slipstream.errors import ModelLoadError
from slipstream.weights import default_model_path


def skip_unless_default_model() -> None:
    """Skip the calling test or fixture when the embedded default model is not installed."""
    try:
        default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


def prefill_step(seq, prompt: list[int], extra: int = 16):
    """A whole prompt as one step into `seq` (a `SequenceKV`, reserved for `extra` more tokens),
    asking for the last position's logits; attention reads gathered slot ids."""
    from slipstream.step import prefill_step as build

    seq.reserve(len(prompt) + extra)
    return build(seq, prompt, gather=True)


def decode_step(seqs: list, tokens: list[int], positions: list[int]):
    """One decode step: token i of sequence i at position i, attending over its gathered slots."""
    from slipstream.step import decode_step as build

    return build(seqs, tokens, positions, gather=True)


def engine(llm, **kw):
    """A fresh `Engine` over an `LLM`'s model and tokenizer, configured by `kw` (`EngineConfig`'s
    fields; 2048 KV tokens and the LLM's CPU path unless given)."""
    from slipstream.engine.config import EngineConfig
    from slipstream.engine.engine import Engine

    kw.setdefault("kv_cache_tokens", 2048)
    kw.setdefault("exact", llm.engine_config.exact)   # the LLM's CPU path (fast or exact)
    return Engine(llm.model, llm.tokenizer, EngineConfig(**kw))
