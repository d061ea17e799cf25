"""The Python API, in the spirit of vLLM's offline one:

    from slipstream import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(out[0].text)
    for chunk in llm.stream("Hello"): print(chunk.text, end="")
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from slipstream.engine.config import EngineConfig
from slipstream.engine.engine import Engine
from slipstream.engine.request import Request, RequestMetrics
from slipstream.engine.sampling import SamplingParams, TokenLogprobs
from slipstream.models import build_model
from slipstream.weights import load_model

Message = dict[str, str]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


@dataclass
class StreamChunk:
    text: str                     # new text since the previous chunk
    token_ids: list[int]          # tokens sampled in this step
    finish_reason: str | None     # set on the last chunk
    request: Request


def _output(r: Request) -> RequestOutput:
    return RequestOutput(r.request_id, r.prompt, r.prompt_ids, r.text, r.output_ids,
                         r.finish_reason, r.logprobs, r.metrics)


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, *, config: EngineConfig | None = None,
                 progress: Callable[[str], None] | None = None, **options: Any):
        """`options`: engine settings by their `EngineConfig` field names (`max_model_len`,
        `kv_cache_tokens`, `max_batch`, `prefill_chunk`, `prefill_budget`, `max_waiting`, `runtime`,
        `enable_prefix_cache`, `enable_merging`, `speculative`, `num_speculative_tokens`, `exact`: the
        exact fp32-activation CPU kernels instead of the int8-activation fast path, ...), applied on top
        of `config` when both are given. `progress` receives a line at each loading stage (the CLI
        prints them)."""
        config = (config or EngineConfig()).with_(**options)
        say = progress or (lambda _msg: None)
        t0 = time.perf_counter()
        say("reading the weights")
        loaded = load_model(model)
        self.model_name = loaded.name
        self.config = loaded.config
        self.engine_config = config
        self.tokenizer = loaded.tokenizer
        say(f"building {loaded.name} ({time.perf_counter() - t0:.1f} s)")
        self.model = build_model(loaded.config, loaded.weights)
        say(f"starting the engine ({time.perf_counter() - t0:.1f} s)")
        self.engine = Engine(self.model, self.tokenizer, config, runtime_hints=loaded.runtime_hints)
        self.load_time_s = time.perf_counter() - t0

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # -- prompts --------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[Message]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _request(self, prompt: str | Sequence[int], params: SamplingParams, chat: bool = False) -> Request:
        if isinstance(prompt, str):
            # a rendered chat template already holds its special tokens
            ids = self.tokenizer.encode(prompt, add_special_tokens=not chat)
            return Request(ids, params, prompt=prompt)
        return Request(list(prompt), params)

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        reqs = [self._request(p, params) for p in prompts]
        for _ in self.engine.run(reqs):
            pass
        return [_output(r) for r in reqs]

    def chat(self, messages: list[Message] | list[list[Message]],
             params: SamplingParams | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        reqs = [self._request(self.chat_prompt(c), params, chat=True) for c in convs]  # type: ignore[arg-type]
        for _ in self.engine.run(reqs):
            pass
        return [_output(r) for r in reqs]

    def stream(self, prompt: str | Sequence[int] | list[Message], params: SamplingParams | None = None,
               ) -> Iterator[StreamChunk]:
        """Yield text as it is generated; a list of messages is rendered with the chat template."""
        params = params or SamplingParams()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            req = self._request(self.chat_prompt(prompt), params, chat=True)  # type: ignore[arg-type]
        else:
            req = self._request(prompt, params)  # type: ignore[arg-type]
        for events in self.engine.run([req]):
            for ev in events:
                yield StreamChunk(ev.text, ev.token_ids, ev.request.finish_reason, ev.request)
