"""Slipstream: a low-latency LLM inference engine."""
from __future__ import annotations

import os

# torch's OpenMP threads (the eager BLAS prefill) sleep when they wait instead of spinning. Spinning
# threads burn the time slices that the native thread team and a busy neighbour need: on a loaded
# 2-core machine a 256-token eager prefill took 4.3-4.7 s spinning and 1.0-2.1 s passive. libgomp reads
# this when torch loads, so it must be set before the first `import torch` (a user's own setting wins).
# Other programs we start as peers (llama.cpp in the benchmarks, whose ggml threads wait in OpenMP
# barriers: passive waits halve its decode speed) get the environment without it: `peer_environ()`.
_OMP_DEFAULTED = "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def peer_environ() -> dict[str, str]:
    """This process's environment as the user set it: for peer engines started as subprocesses."""
    env = dict(os.environ)
    if _OMP_DEFAULTED:
        env.pop("OMP_WAIT_POLICY", None)
    return env

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__", "peer_environ"]


def __getattr__(name: str):
    # lazy, so `import slipstream` (e.g. for the CLI's --help) does not load torch
    if name == "LLM":
        from slipstream.api import LLM
        return LLM
    if name == "SamplingParams":
        from slipstream.engine.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
