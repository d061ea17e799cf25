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
