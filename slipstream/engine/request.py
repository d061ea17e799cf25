"""One generation request and what it has produced so far."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from slipstream.engine.sampling import SamplingParams, TokenLogprobs
from slipstream.kv.blocks import SequenceKV

_ids = itertools.count()


@dataclass
class RequestMetrics:
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    num_output_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second after the first one (the decode speed, prefill excluded)."""
        if self.finished is None or self.first_token is None or self.num_output_tokens < 2:
            return None
        dt = self.finished - self.first_token
        return (self.num_output_tokens - 1) / dt if dt > 0 else None


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""               # final text (stop strings cut off)
    emitted: int = 0             # characters of `text` already handed to a streaming caller
    finish_reason: str | None = None
    kv: SequenceKV | None = None
    generator: torch.Generator | None = None
    detok: object | None = None  # IncrementalDetokenizer
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
