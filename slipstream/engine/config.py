"""The engine's settings as one frozen, validated value.

`slipstream generate|chat|serve` build one from their flags, `LLM(...)` from its keyword arguments;
`Engine` and `Scheduler` take it whole. Every field is checked once, here, and a bad value raises
`ConfigError` (a `SlipstreamError`, so the CLI prints it as one line; also a `ValueError`).
Import-light: the CLI builds one before importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from slipstream.errors import ConfigError

SPEC_MAX_BATCH = 3   # see EngineConfig.speculative_max_batch
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "int8")   # see EngineConfig.kv_cache_dtype


class EngineConfigError(ConfigError):
    """A bad value of one field: `field`, then `problem` (e.g. "must be an integer >= 1, got 0"), so a
    caller can name the setting its own way (the CLI names its flag)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int | None = None      # context length (None: the model's)
    kv_cache_tokens: int | None = None    # KV-cache size in tokens (None: from a 1 GiB budget)
    block_size: int = 16                  # tokens per KV block
    max_batch: int = 8                    # most sequences decoded together
    prefill_chunk: int = 512              # prompt tokens per prefill step
    prefill_budget: int | None = None     # prompt tokens in a step that also decodes (None: prefill_chunk);
                                          # bounds how long a running stream waits behind a burst of prompts
    prefill_pacing: float | None = None   # size that budget from measured step times instead, so a step that
                                          # decodes takes at most this many decode-only steps' time (> 1;
                                          # prefill_budget is then the first guess); None: the fixed budget
    max_waiting: int | None = None        # most requests queued for a batch slot (None: no limit)
    runtime: str = "auto"                 # decode-step executor, by registry name (runtime/registry.py)
    enable_prefix_cache: bool = True
    enable_merging: bool = True           # identical deterministic requests share one computation
    speculative: str | None = None        # ngram | mtp | draft:MODEL
    num_speculative_tokens: int = 4       # guesses verified per step
    # Speculation verifies K+1 rows per sequence; the matvec kernels' cost grows with rows, so past
    # this many running sequences a step of plain decoding gives more tokens per second. Measured on
    # the 2-core CPU with K=4 on an echo task (benchmarks/spec_decode.py --batch-sweep): 1.24x at 1
    # sequence, 1.08x at 2, 1.07x at 3, 0.99x at 4, 0.76x at 8.
    speculative_max_batch: int = SPEC_MAX_BATCH
    # use the exact fp32-activation CPU kernels instead of the int8-activation fast path
    exact: bool = False
    # the KV cache's element type on the CPU: "fp16" (half the bytes per token: twice the tokens in the same
    # memory, half the bytes attention reads), "int8" (8-bit codes and a float32 scale per row of head_dim:
    # about half of fp16's bytes; not under the exact path), "fp32", or "auto": fp16 under the native
    # runtime's fast path, fp32 under its exact path (compared with transformers) and under the eager CPU
    # step. On a GPU the cache takes the weights' dtype whatever this says ("auto" only).
    kv_cache_dtype: str = "auto"
    # compute threads on the CPU (llama.cpp's -t): the native step's team and torch's pool for the eager step
    # and prompt GEMMs. None: one per core this process may run on (SLIPSTREAM_THREADS overrides that default).
    # Beside a busy neighbour the native team still shrinks below this to the cores left free.
    threads: int | None = None

    def __post_init__(self) -> None:
        from slipstream.runtime.registry import runtime_names

        def integer(name: str, lo: int, hi: int | None = None, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
                bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
                raise EngineConfigError(name, f"must be an integer {bound}, got {v!r}")
        integer("max_model_len", 2, optional=True)
        integer("kv_cache_tokens", 1, optional=True)
        integer("block_size", 1)
        integer("max_batch", 1)
        integer("prefill_chunk", 1)
        integer("prefill_budget", 1, optional=True)
        integer("max_waiting", 1, optional=True)
        integer("threads", 1, 256, optional=True)   # step.c's MAX_THREADS
        p = self.prefill_pacing
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 1):
            raise EngineConfigError("prefill_pacing", f"must be a number > 1 (or off), got {p!r}")
        integer("num_speculative_tokens", 1, 16)
        integer("speculative_max_batch", 0)
        if self.runtime not in runtime_names():
            raise ConfigError(f"unknown runtime {self.runtime!r} ({', '.join(runtime_names())})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError("kv_cache_dtype",
                                    f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        for name in ("enable_prefix_cache", "enable_merging", "exact"):
            if not isinstance(getattr(self, name), bool):
                raise EngineConfigError(name, f"must be true or false, got {getattr(self, name)!r}")

    @property
    def spec_rows(self) -> int:
        """Most rows one decode step holds: K + 1 per sequence when speculating."""
        return self.max_batch * (self.num_speculative_tokens + 1 if self.speculative else 1)

    def with_(self, **changes: Any) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
