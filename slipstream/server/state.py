"""The small state every route is a function of: the model's tokenizer and limits, the engine
thread, the worker pool, the metrics and the server's settings (`AppState`), and the checks the
routes share (model name, context budget, sampling parameters, submission errors)."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from slipstream.engine.sampling import SamplingParams, TokenLogprobs
from slipstream.errors import PromptTooLongError, QueueFullError, SlipstreamError
from slipstream.server.async_engine import AsyncEngine, EngineDrainingError, EngineFailedError, RequestStream
from slipstream.server.config import ServerConfig
from slipstream.server.metrics import ServerMetrics
from slipstream.server.protocol import APIError, bad_request, unavailable
from slipstream.structured.constraint import Constraint, ConstraintError
from slipstream.structured.reasoning import uses_reasoning
from slipstream.structured.tool_parsers import parser_for_template, template_has_tools

log = logging.getLogger("slipstream.server")
T = TypeVar("T")
LOGPROB_FLOOR = -9999.0   # JSON has no -inf


def _lp(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenText:
    """A token's text and exact bytes, as logprobs report them (cached per id)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_of: dict[str, int] | None = None
        decoder = getattr(getattr(tokenizer, "backend", None), "decoder", None)
        if type(decoder).__name__ == "ByteLevel":
            from slipstream.tokenizer import gpt2_byte_alphabet
            self._byte_of = {c: b for b, c in gpt2_byte_alphabet().items()}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tok.id_to_token(token_id)
        if raw is not None:
            if self._byte_of is not None and all(c in self._byte_of for c in raw):
                b = bytes(self._byte_of[c] for c in raw)
                return b.decode("utf-8", errors="replace"), list(b)
            if len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):   # SentencePiece byte fallback
                try:
                    b = bytes([int(raw[3:5], 16)])
                    return b.decode("utf-8", errors="replace"), list(b)
                except ValueError:
                    pass
        text = self.tok.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))


class WorkerPool:
    """CPU-heavy request work (JSON parsing, validation, chat templates, tokenizing) on a few
    threads instead of the event loop, with a bounded queue: past it a request gets 503."""

    def __init__(self, workers: int, max_queued: int, retry_after_s: int):
        self._ex = ThreadPoolExecutor(workers, thread_name_prefix="slipstream-http")
        self._limit = workers + max_queued
        self._retry_after_s = retry_after_s
        self.pending = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.pending >= self._limit:
            raise unavailable(f"the server is busy preparing {self.pending} other requests; retry shortly",
                              "server_busy", self._retry_after_s)
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._ex, fn, *args)
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)


class AppState:
    """What the routes read: built once per app."""

    def __init__(self, llm: Any, config: ServerConfig):
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer
        self.model_id = config.served_model_name or llm.model_name
        self.model_names = {self.model_id, llm.model_name}
        self.model_len: int = llm.max_model_len
        engine = llm.engine
        kv = getattr(engine, "kv", None)
        self.kv_tokens: int | None = getattr(kv, "capacity_tokens", None)
        # the context one request can actually have: the model's, or less when the KV cache is smaller
        self.max_model_len = min(self.model_len, self.kv_tokens) if self.kv_tokens else self.model_len
        sched = getattr(engine, "scheduler", None)
        self.max_waiting: int | None = getattr(sched, "max_waiting", None) if sched is not None else \
            getattr(engine, "max_waiting", None)
        self.max_prompt_chars = config.prompt_chars(self.model_len)
        self.created = int(time.time())
        self.metrics = ServerMetrics(stats=lambda: self.engine.stats())
        self.engine = AsyncEngine(engine, metrics=self.metrics)
        self.pool = WorkerPool(config.workers, config.max_queued_jobs, config.retry_after_s)
        self.token_text = TokenText(self.tokenizer)
        self.draining = False
        # tools and reasoning: read from the chat template unless the config names them
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_parser = config.tool_parser or parser_for_template(template) or "hermes"
        self.template_renders_tools = template_has_tools(template)
        self.reasoning = config.reasoning_parser == "think" or \
            (config.reasoning_parser is None and uses_reasoning(template))

    # -- checks (run on the worker threads: no event-loop state here) ----------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model[:200]}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")

    def check_chars(self, n_chars: int, what: str, param: str) -> None:
        if n_chars > self.max_prompt_chars:
            raise bad_request(f"The {what} has {n_chars} characters; this server takes at most "
                              f"{self.max_prompt_chars} (--max-prompt-chars).", param, "prompt_too_long")

    def check_stops(self, stop: str | list[str] | None) -> None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        c = self.config
        if len(stops) > c.max_stop_sequences:
            raise bad_request(f"At most {c.max_stop_sequences} stop sequences are allowed, got {len(stops)}.",
                              "stop", "invalid_value")
        for i, s in enumerate(stops):
            if len(s) > c.max_stop_chars:
                raise bad_request(f"A stop sequence may have at most {c.max_stop_chars} characters, got {len(s)}.",
                                  "stop" if isinstance(stop, str) else f"stop[{i}]", "invalid_value")

    def check_choices(self, n: int, prompts: int, param: str) -> None:
        total = n * prompts
        if total > self.config.max_choices:
            raise bad_request(f"n x prompts is {total} ({n} x {prompts}); this server takes at most "
                              f"{self.config.max_choices} per request (--max-choices).", param, "too_many_choices")
        if self.max_waiting is not None and total > self.max_waiting:
            raise bad_request(f"n x prompts is {total} ({n} x {prompts}), more than the {self.max_waiting} requests "
                              "the queue can ever hold (--max-waiting): this request can never be served.",
                              param, "too_many_choices")

    def max_tokens_for(self, n_prompt: int, requested: int | None, what: str, param: str) -> int:
        L = self.max_model_len
        why = "" if L == self.model_len else \
            f" (the model's is {self.model_len}; the KV cache holds {self.kv_tokens} tokens)"
        if n_prompt == 0:
            raise bad_request(f"The {what} is empty (0 tokens).", param)
        if n_prompt >= L:
            raise bad_request(f"This model's maximum context length is {L} tokens{why}. However, your {what} "
                              f"resulted in {n_prompt} tokens, which leaves no room for a completion. "
                              f"Please reduce the length of the {what}.", param, "context_length_exceeded")
        if requested is None:
            return L - n_prompt
        if n_prompt + requested > L:
            raise bad_request(f"This model's maximum context length is {L} tokens{why}. However, you requested "
                              f"{n_prompt + requested} tokens ({n_prompt} in the {what}, {requested} in the "
                              f"completion). Please reduce the length of the {what} or completion.",
                              param, "context_length_exceeded")
        return requested

    def check_constraint(self, c: Constraint, param: str) -> None:
        """Compile the constraint for this tokenizer once (a bad schema or grammar is a 400 here)."""
        from slipstream.structured.grammar import compile_constraint

        try:
            compile_constraint(self.tokenizer, c)
        except ConstraintError as e:
            raise bad_request(str(e), param, e.code) from None

    @staticmethod
    def sampling(req: Any, max_tokens: int, logprobs: int | None, n: int,
                 extra: dict[str, Any] | None = None) -> list[SamplingParams]:
        kw = dict(req.sampling_kwargs(), **(extra or {}))
        out = []
        for i in range(n):
            seed = None if req.seed is None else req.seed + i
            try:
                out.append(SamplingParams(max_tokens=max_tokens, seed=seed, logprobs=logprobs, **kw))
            except ValueError as e:
                name = str(e).split(" ", 1)[0]
                raise bad_request(str(e), name if name in type(req).model_fields else None) from None
        return out

    # -- the engine (event loop) -------------------------------------------------------------------
    async def submit(self, items: list[tuple[list[int], SamplingParams]], priority: int,
                     param: str) -> RequestStream:
        retry = self.config.retry_after_s
        try:
            return await self.engine.submit(items, priority)
        except EngineDrainingError as e:
            raise unavailable(str(e), "server_shutting_down", retry) from None
        except EngineFailedError as e:
            raise APIError(500, str(e), "server_error", None, "internal_error") from None
        except QueueFullError as e:
            raise unavailable(f"{e}", "queue_full", retry) from None
        except PromptTooLongError as e:
            raise bad_request(str(e), param, "context_length_exceeded") from None
        except (SlipstreamError, ValueError) as e:
            raise bad_request(str(e), param) from None

    # -- logprobs formats ----------------------------------------------------------------------
    def chat_logprobs(self, lps: list[TokenLogprobs]) -> list[dict[str, Any]]:
        out = []
        for lp in lps:
            text, b = self.token_text(lp.token_id)
            top = []
            for tid, v in lp.top:
                t2, b2 = self.token_text(tid)
                top.append({"token": t2, "logprob": _lp(v), "bytes": b2})
            out.append({"token": text, "logprob": _lp(lp.logprob), "bytes": b, "top_logprobs": top})
        return out

    def completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> tuple[dict[str, Any], int]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text, _ = self.token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(_lp(lp.logprob))
            top = {self.token_text(tid)[0]: _lp(v) for tid, v in lp.top}
            top.setdefault(text, _lp(lp.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset
