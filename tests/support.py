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
    asking for the last position's logits."""
    import torch

    from slipstream.models.llama import SeqSlice, StepInput

    n = len(prompt)
    seq.reserve(n + extra)
    return StepInput(torch.tensor(prompt), torch.arange(n), seq.slots(0, n), [SeqSlice(0, n, n, seq.slots(0, n))],
                     torch.tensor([n - 1]))


def decode_step(seqs: list, tokens: list[int], positions: list[int]):
    """One decode step: token i of sequence i at position i, attending over its gathered slots."""
    import torch

    from slipstream.models.llama import SeqSlice, StepInput

    slots = torch.cat([s.slots(p, p + 1) for s, p in zip(seqs, positions)])
    sl = [SeqSlice(i, 1, p + 1, s.slots(0, p + 1)) for i, (s, p) in enumerate(zip(seqs, positions))]
    return StepInput(torch.tensor(tokens), torch.tensor(positions), slots, sl, torch.arange(len(seqs)))


def engine(llm, **kw):
    """A fresh `Engine` over an `LLM`'s model and tokenizer (2048 KV tokens unless given)."""
    from slipstream.engine.engine import Engine

    kw.setdefault("kv_cache_tokens", 2048)
    return Engine(llm.model, llm.tokenizer, **kw)
