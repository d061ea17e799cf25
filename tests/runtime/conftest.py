"""Fixtures shared by the runtime tests."""
from __future__ import annotations

import pytest
from support import skip_unless_default_model

from slipstream.models.llama import LlamaModel


@pytest.fixture(scope="module")
def smollm2() -> LlamaModel:
    """The embedded default model (SmolLM2-135M, Q4_1) as the CPU runtimes take it; skipped where it is absent."""
    skip_unless_default_model()
    from slipstream.weights import load_model
    m = load_model(None)
    return LlamaModel(m.config, m.weights)
