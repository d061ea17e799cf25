"""Fixtures of the engine tests: the embedded default model, loaded once per module."""
import pytest
from support import skip_unless_default_model

from slipstream import LLM


@pytest.fixture(scope="module")
def llm() -> LLM:
    skip_unless_default_model()
    # the exact CPU path: these tests check that a request's tokens do not depend on its batch, its
    # prompt's chunking or a preemption, which holds bit for bit only when prefill and decode round
    # alike (fp32 activations); the int8 fast path's prefill and decode share the products' rounding
    # but not every fp32 operator's, so a batch can flip a near-tie there (see README)
    return LLM(kv_cache_tokens=4096, exact=True)
