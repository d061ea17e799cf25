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


# byte offsets of each ggml block type's fp16 scale fields, and the largest |code x sub-scale| a
# random block can hold (to choose scales that give weights of a wanted size)
_F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 20: (0,), 10: (80, 82), 11: (108,),
               12: (0, 2), 13: (0, 2), 14: (208,), 23: (0,)}
_CODE_RANGE = {2: 8, 3: 15, 6: 16, 7: 31, 8: 127, 20: 127, 10: 45, 11: 128, 12: 945, 13: 1953, 14: 4064, 23: 4064}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0, size: float = 0.0):
    """[n, row bytes] uint8: valid ggml blocks of `qtype` built by hand (random codes and scale
    bytes, random sane fp16 scales), for the types gguf-py cannot quantize. With `size`, weights are
    of about that magnitude (the offsets of types with a minimum too)."""
    import gguf
    import numpy as np
    rng = np.random.default_rng(seed)
    qk, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    b = rng.integers(0, 256, size=(n, k // qk, bb), dtype=np.uint8)
    for i, off in enumerate(_F16_FIELDS[qtype]):
        if size:
            d = rng.uniform(0.5, 1.0, size=(n, k // qk)) * size / _CODE_RANGE[qtype]
        else:
            d = rng.uniform(0.5, 2.0, size=(n, k // qk)) * 10.0 ** rng.integers(-4, -1, size=(n, k // qk))
        if i == 0:
            d *= rng.choice([-1.0, 1.0], size=d.shape)
        b[..., off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(n, k // qk, 2)
    return b.reshape(n, -1)
