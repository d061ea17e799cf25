"""A scripted stand-in for the engine (and an LLM around it) for server tests that need no model.

FakeEngine follows the Engine contract the server codes against (add_request / abort / step /
has_unfinished / stats, one thread): every running request gets one token per step, token k
spelling 't<k> '. FakeLLM wraps it with a tiny whitespace tokenizer.
"""
from __future__ import annotations

import threading
import time

from slipstream.engine.engine import EngineStats, StepEvent
from slipstream.engine.sampling import TokenLogprobs
from slipstream.errors import PromptTooLongError, QueueFullError


class FakeEngine:
    """One token per running request per step; token k of a request spells 't<k> '."""

    def __init__(self, step_s: float = 0.002, max_waiting: int = 100, fail_at_step: int | None = None):
        self.step_s = step_s
        self.max_waiting = max_waiting
        self.fail_at_step = fail_at_step
        self.requests: dict = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.thread_ids: set[int] = set()

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def add_request(self, r) -> None:
        self._touch()
        if len(r.prompt_ids) > 10:
            raise PromptTooLongError(f"the prompt has {len(r.prompt_ids)} tokens but the context length is 10")
        if len(self.requests) >= self.max_waiting:
            raise QueueFullError("the waiting queue is full")
        self.requests[r.request_id] = r

    def abort(self, request_id: str) -> None:
        self._touch()
        r = self.requests.pop(request_id, None)
        if r is not None:
            r.finish_reason = "abort"
            self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[StepEvent]:
        self._touch()
        self.steps += 1
        if self.fail_at_step is not None and self.steps == self.fail_at_step:
            raise RuntimeError("boom")
        time.sleep(self.step_s)
        now = time.perf_counter()
        events = []
        for rid, r in list(self.requests.items()):
            if r.metrics.scheduled is None:
                r.metrics.scheduled = now
            tok = len(r.output_ids) + 1
            r.output_ids.append(tok)
            r.metrics.num_output_tokens += 1
            if r.metrics.first_token is None:
                r.metrics.first_token = now
            if len(r.output_ids) >= r.params.max_tokens:
                r.finish_reason = "length"
                r.metrics.finished = now
                del self.requests[rid]
            lps = [] if r.params.logprobs is None else \
                [TokenLogprobs(tok, -0.5, [(tok, -0.5), (tok + 1, -1.5)][:r.params.logprobs])]
            events.append(StepEvent(r, f"t{tok} ", [tok], lps))
        return events

    def stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, 64, len(self.requests), 0, 0, 0, 0)


class FakeTokenizer:
    """Word-level: a word encodes to its length (so ids stay small); id i decodes to 't<i> '."""

    vocab_size = 100
    backend = None
    eos_token_ids = {0}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "explode" in text:
            raise RuntimeError("tokenizer bug")
        return [min(len(w), 99) for w in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"t{i} " for i in ids)

    def id_to_token(self, i: int) -> str:
        return f"t{i} "

    chat_template: str | None = None

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return text + ("\nassistant:" if add_generation_prompt else "")


class FakeLLM:
    """What the server uses of `slipstream.LLM`, over a FakeEngine (its prompts stop at 10 tokens)."""

    model_name = "fake-model"
    max_model_len = 64

    def __init__(self, engine: FakeEngine | None = None):
        self.engine = engine or FakeEngine()
        self.tokenizer = FakeTokenizer()
        self.tokenizer.chat_template = getattr(self.engine, "chat_template", None)

    def chat_prompt(self, messages) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


class ScriptedEngine(FakeEngine):
    """Every request answers `script` (a few characters per step, then "stop"): a model whose output
    is forced, for testing how the server reads it (tool calls, reasoning)."""

    def __init__(self, script: str, chat_template: str | None = None, chars_per_step: int = 7,
                 step_s: float = 0.001):
        super().__init__(step_s=step_s)
        self.script = script
        self.chat_template = chat_template   # the FakeLLM's tokenizer gets it (the server reads formats from it)
        self.chars_per_step = chars_per_step

    def step(self) -> list[StepEvent]:
        self._touch()
        self.steps += 1
        time.sleep(self.step_s)
        now = time.perf_counter()
        events = []
        for rid, r in list(self.requests.items()):
            if r.metrics.scheduled is None:
                r.metrics.scheduled = now
            if r.metrics.first_token is None:
                r.metrics.first_token = now
            start = len(r.output_ids) * self.chars_per_step
            piece = self.script[start:start + self.chars_per_step]
            r.output_ids.append(len(r.output_ids) + 1)
            r.metrics.num_output_tokens += 1
            if start + self.chars_per_step >= len(self.script) or len(r.output_ids) >= r.params.max_tokens:
                r.finish_reason = "stop" if start + self.chars_per_step >= len(self.script) else "length"
                r.metrics.finished = now
                del self.requests[rid]
            events.append(StepEvent(r, piece, [r.output_ids[-1]], []))
        return events

