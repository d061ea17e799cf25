"""Fixtures of the engine tests: the embedded default model, loaded once per module."""
import pytest
from support import skip_unless_default_model

from slipstream import LLM


@pytest.fixture(scope="module")
def llm() -> LLM:
    skip_unless_default_model()
    return LLM(kv_cache_tokens=4096)
