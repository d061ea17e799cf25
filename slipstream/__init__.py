"""Slipstream: a low-latency LLM inference engine."""
from __future__ import annotations

import os

# torch's OpenMP threads (the eager BLAS prefill) sleep when they wait instead of spinning. Spinning
# threads burn the time slices that the native thread team and a busy neighbour need: on a loaded
# 2-core machine a 256-token eager prefill took 4.3-4.7 s spinning and 1.0-2.1 s passive. libgomp reads
# this when torch loads, so it must be set before the first `import torch` (a user's own setting wins).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
