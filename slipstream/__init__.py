"""Slipstream: a low-latency LLM inference engine."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # lazy, so `import slipstream` (e.g. for the CLI's --help) does not load torch
    if name == "LLM":
        from slipstream.api import LLM
        return LLM
    if name == "SamplingParams":
        from slipstream.engine.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
