"""One generation request and what it has produced so far."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.engine.sampling import SamplingParams, TokenLogprobs
from slipstream.kv.blocks import SequenceKV

_ids = itertools.count()
_arrivals = itertools.count()


@dataclass
class RequestMetrics:
    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None    # first admitted to the running batch
    first_token: float | None = None
    finished: float | None = None
    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache (not computed)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_s(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second after the first one (the decode speed, prefill excluded)."""
        if self.finished is None or self.first_token is None or self.num_output_tokens < 2:
            return None
        dt = self.finished - self.first_token
        return (self.num_output_tokens - 1) / dt if dt > 0 else None


@dataclass(eq=False)   # identity, not field equality: two identical requests are two requests
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    priority: int = 0            # lower is served first (vLLM's convention)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""               # final text (stop strings cut off)
    emitted: int = 0             # characters of `text` already handed to a streaming caller
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    kv: SequenceKV | None = None
    generator: torch.Generator | None = None
    detok: Any = None            # IncrementalDetokenizer
    matcher: Any = None          # structured.grammar.Matcher when params.constraint is set
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # scheduling state
    arrival_seq: int = field(default_factory=lambda: next(_arrivals))  # FIFO tie-break
    num_preemptions: int = 0
    # request merging: identical requests in flight share one computation
    merged_into: Request | None = field(default=None, repr=False)
    followers: list[Request] = field(default_factory=list, repr=False)
    detached: bool = False       # its own caller left, but followers still want the tokens

    def __post_init__(self) -> None:
        self.own_priority = self.priority   # what its caller asked for (merging may raise `priority`)

    @property
    def seq(self) -> SequenceKV:
        """The KV of a request that holds blocks (scheduled, not preempted)."""
        if self.kv is None:
            raise RuntimeError(f"request {self.request_id} holds no KV blocks")
        return self.kv

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_target(self) -> int:
        """Tokens whose KV must be computed before the next decode step.

        A new request computes its whole prompt (and samples from the last position); one that
        was preempted after generating recomputes everything but its last sampled token, which
        the next decode step feeds in as usual.
        """
        return len(self.prompt_ids) if not self.output_ids else self.num_tokens - 1

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.arrival_seq)
