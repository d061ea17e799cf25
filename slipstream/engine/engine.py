"""The generation loop: continuous batching over a paged, prefix-cached KV store.

`add_request` validates a request and queues it (or merges it into an identical one in flight);
every `step()` is

    schedule (scheduler.py) -> execute (execute.py: a decode batch, speculative or plain, and a batch
    of prompt chunks) -> sample (sampling.py, grammar masks) -> process outputs (output.py)

and returns what each request produced, so callers can stream. Requests join and leave the batch
at every step. The parts: `Scheduler` (which requests run), `StepExecutor` (forward steps and KV
bookkeeping), `Speculation` (verify.py: guesses and their verification), `OutputProcessor` (stop
strings, held-back text, detokenizing, logprobs, events), `Merger` (merging.py: identical requests
share one computation). The engine is single-threaded: the server drives it from one thread
(server/async_engine.py), the offline API through `run()`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from slipstream.engine.config import EngineConfig
from slipstream.engine.execute import StepExecutor
from slipstream.engine.merging import Merger
from slipstream.engine.output import OutputProcessor, StepEvent
from slipstream.engine.prefill_pacer import PrefillPacer
from slipstream.engine.request import Request
from slipstream.engine.sampling import Sampler, TokenLogprobs, make_generator
from slipstream.engine.scheduler import Scheduler
from slipstream.engine.speculative import SpecStats, make_proposer
from slipstream.engine.verify import Speculation
from slipstream.errors import PromptTooLongError, SlipstreamError
from slipstream.kv.prefix_cache import PrefixCache
from slipstream.models.base import Model
from slipstream.runtime.base import Decoder, DecoderOptions
from slipstream.runtime.registry import (
    build_decoder,
    kv_bytes_per_token,
    kv_cache_dtype,
    new_kv_cache,
    placement,
    resolve_runtime,
)
from slipstream.structured.constraint import ConstraintError
from slipstream.structured.grammar import Matcher, compile_constraint
from slipstream.structured.masks import MaskJob, MaskNow, constrained_logits

__all__ = ["Engine", "EngineStats", "StepEvent", "KV_BUDGET_BYTES"]

KV_BUDGET_BYTES = 1 << 30   # KV-cache size when not given: up to twice the context, within this


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_in_use: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    merged_requests: int
    preemptions: int
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    spec_emitted_tokens: int = 0
    spec_accepted_at: tuple[int, ...] = ()

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_in_use / self.kv_blocks_total if self.kv_blocks_total else 0.0


class Engine:
    def __init__(self, model: Model, tokenizer: Any, config: EngineConfig | None = None,
                 runtime_hints: dict | None = None):
        """`runtime_hints`: a compiled artifact's kernel configurations and megakernel plans."""
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        cfg = model.cfg
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.runtime_name = resolve_runtime(config.runtime, model)
        # the cache's element type (EngineConfig.kv_cache_dtype; None: the model's own)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.runtime_name, model, config.exact)
        kv_cache_tokens = config.kv_cache_tokens
        if kv_cache_tokens is None:
            per_token = kv_bytes_per_token(model, kv_dtype)
            kv_cache_tokens = max(self.max_model_len, min(2 * self.max_model_len, KV_BUDGET_BYTES // per_token))
        device = placement(self.runtime_name, model)
        if model.device.type != device:
            model.to(device)
        if config.threads is not None and device == "cpu":
            torch.set_num_threads(config.threads)   # the eager step and prompt GEMMs; the native team gets it below
        block_size = config.block_size
        self.kv = new_kv_cache(model, -(-kv_cache_tokens // block_size), block_size, kv_dtype)
        self.prefix_cache = PrefixCache(self.kv, enabled=config.enable_prefix_cache)
        self.scheduler = Scheduler(self.kv, self.prefix_cache, config)
        self.sampler = Sampler()
        self.vocab_size = cfg.vocab_size
        self.runtime: Decoder = build_decoder(
            self.runtime_name, model, self.kv,
            DecoderOptions(max_rows=config.spec_rows, max_context=self.max_model_len,
                           hints=runtime_hints or {}, exact=config.exact, threads=config.threads))
        try:
            proposer = make_proposer(config.speculative, config.num_speculative_tokens, model, tokenizer)
        except ValueError as e:
            raise SlipstreamError(str(e)) from None
        # grammar masks overlap the decode step only when the model runs off the CPU
        self._masks_while_stepping = model.device.type != "cpu"
        self.executor = StepExecutor(model, self.kv, self.prefix_cache, self.runtime, proposer)
        if self.executor.needs_hidden:
            proposer.kv = self.kv
            if self.runtime.name != "eager":
                raise SlipstreamError("MTP speculation needs the eager runtime (it reads hidden states)")
        self.output = OutputProcessor(tokenizer, self.max_model_len)
        self.spec = SpecStats(config.num_speculative_tokens)
        self.speculation = Speculation(proposer, self.executor, self.output, self.spec,
                                       config.speculative_max_batch, self.max_model_len, self.vocab_size)
        self.merger = Merger(self.scheduler, config.enable_merging)
        # prompt tokens per decoding step sized from measured step times (EngineConfig.prefill_pacing)
        self.pacer = None if config.prefill_pacing is None else PrefillPacer(
            factor=config.prefill_pacing, initial=config.prefill_budget or 16, ceiling=config.prefill_chunk)
        self.requests: dict[str, Request] = {}     # in flight, followers included
        self._pending: list[StepEvent] = []        # produced outside a step, returned by the next

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    @property
    def prefill_chunk(self) -> int:
        return self.scheduler.prefill_chunk

    @property
    def proposer(self) -> Any:
        """The speculative proposer (None: no speculation); replaceable (tests, benchmarks)."""
        return self.speculation.proposer

    @proposer.setter
    def proposer(self, proposer: Any) -> None:
        self.speculation.proposer = proposer

    @property
    def spec_max_batch(self) -> int:
        """Past this many running sequences a step decodes plainly (EngineConfig.speculative_max_batch)."""
        return self.speculation.max_batch

    @spec_max_batch.setter
    def spec_max_batch(self, n: int) -> None:
        self.speculation.max_batch = n

    @property
    def needs_hidden(self) -> bool:
        return self.executor.needs_hidden

    @property
    def num_merged(self) -> int:
        return self.merger.num_merged

    # -- requests in and out --------------------------------------------------------------------
    def check_prompt(self, ids: list[int]) -> None:
        n_prompt = len(ids)
        if n_prompt == 0:
            raise SlipstreamError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise SlipstreamError(f"prompt token id {bad!r} is outside the vocabulary (0..{vocab - 1})")
        if n_prompt >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {n_prompt} tokens but the context length is "
                                     f"{self.max_model_len} (room is needed for at least one new token)")
        need = -(-(n_prompt + 1) // self.kv.block_size)
        if need > self.kv.num_blocks:
            raise SlipstreamError(f"the KV cache holds {self.kv.capacity_tokens} tokens, too few for a "
                                  f"prompt of {n_prompt}")

    def add_request(self, r: Request) -> None:
        """Queue a request (validated first); raises SlipstreamError subclasses on bad input."""
        self.check_prompt(r.prompt_ids)
        if r.request_id in self.requests:
            raise SlipstreamError(f"request id {r.request_id!r} is already in flight")
        primary = self.merger.primary_for(r)
        if primary is not None:
            self.requests[r.request_id] = r
            caught_up = self.merger.follow(r, primary)
            if caught_up is not None:
                self._pending.append(caught_up)
            return
        if r.params.max_tokens == 0:
            r.finish_reason = "length"
            r.metrics.scheduled = r.metrics.finished = time.perf_counter()
            self._pending.append(StepEvent(r, "", []))
            return
        if r.params.constraint is not None:
            r.matcher = self._matcher(r)
        self.scheduler.add(r)            # may raise QueueFullError
        r.generator = make_generator(r.params.seed)
        r.detok = self.tokenizer.detokenizer(r.params.skip_special_tokens)
        self.requests[r.request_id] = r
        self.merger.add(r)

    def _matcher(self, r: Request) -> Matcher:
        """The grammar matcher of a constrained request (a bad constraint is the caller's error)."""
        assert r.params.constraint is not None
        try:
            grammar = compile_constraint(self.tokenizer, r.params.constraint, self.vocab_size)
            return Matcher(grammar, self.tokenizer, self.vocab_size)
        except ConstraintError as e:
            raise SlipstreamError(str(e)) from None

    def abort(self, request_id: str) -> None:
        """Stop a request now (its caller left): its blocks are freed and it produces no more events."""
        r = self.requests.pop(request_id, None)
        if r is None:
            return
        if r.finished:   # finished in a step that then failed: retire it now, blocks included
            if r.kv is not None:
                self._retire(r)
            return
        r.finish_reason = "abort"
        r.metrics.finished = time.perf_counter()
        unwanted = self.merger.leave(r)
        if unwanted is not None:
            self._drop(unwanted)

    def _drop(self, r: Request) -> None:
        if r.finish_reason is None:
            r.finish_reason = "abort"
        if self.proposer is not None:
            self.proposer.release(r.request_id)
        self.scheduler.remove(r)
        self.requests.pop(r.request_id, None)
        self.merger.remove(r)

    def _retire(self, r: Request) -> None:
        if self.proposer is not None:
            self.proposer.release(r.request_id)
        self.scheduler.remove(r)
        self.requests.pop(r.request_id, None)
        for f in r.followers:
            self.requests.pop(f.request_id, None)
        self.merger.remove(r)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._pending)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), self.kv.num_blocks, self.kv.allocator.num_in_use,
                           self.prefix_cache.queried_tokens, self.prefix_cache.hit_tokens,
                           self.num_merged, s.num_preemptions, self.spec.drafted, self.spec.accepted,
                           self.spec.verifications, self.spec.emitted, tuple(self.spec.accepted_at))

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Run one scheduler step; returns the events of every request that produced something."""
        events, self._pending = self._pending, []
        started = time.perf_counter()
        if self.pacer is not None:
            self.scheduler.prefill_budget = self.pacer.budget()
        plan = self.scheduler.schedule()
        for r in plan.out_of_kv:   # a lone sequence has filled the whole cache
            events += self.output.finish(r, "length", time.perf_counter())
        if self.proposer is None and self.executor.can_merge(plan.decode, plan.prefill):
            events += self._decode_and_prefill(plan.decode, plan.prefill)
        else:
            if plan.decode:
                events += self._decode(plan.decode)
            for batch in self.executor.prefill_batches(plan.prefill):
                done, logits = self.executor.prefill(batch)
                if done:   # requests whose prompt is complete: their first token
                    events += self._sample(done, logits)
        for r in [r for r in self.scheduler.running if r.finished]:
            self._retire(r)
        if self.pacer is not None:
            self.pacer.observe(bool(plan.decode), sum(e - s for _, s, e in plan.prefill),
                               time.perf_counter() - started)
        return events

    def _decode_and_prefill(self, batch: list[Request], chunks: list[tuple[Request, int, int]]) -> list[StepEvent]:
        """Decode rows and prompt chunks in one runtime step (the weights read once for both)."""
        done_now = [r for r, _, end in chunks if end == r.prefill_target and not r.output_ids]
        if self.executor.device_greedy(batch + done_now):   # tokens chosen by the runtime: no logits, no torch
            tokens, done, done_tokens = self.executor.decode_and_prefill(batch, chunks, tokens_only=True)
            return self._emit(batch + done, tokens.tolist() + done_tokens.tolist())
        constrained = [r.matcher for r in batch]
        masker = MaskJob if self._masks_while_stepping else MaskNow
        job = masker(constrained, self.vocab_size) if any(m is not None for m in constrained) else None
        logits, done, done_logits = self.executor.decode_and_prefill(batch, chunks)
        events = self._sample(batch, logits, job.result() if job is not None else None)
        if done:
            events += self._sample(done, done_logits)
        return events

    def _decode(self, batch: list[Request]) -> list[StepEvent]:
        """One new token for every running sequence (more where speculation's guesses hold)."""
        proposal = self.speculation.propose(batch)
        if proposal is not None:
            return self.speculation.verify(batch, proposal)
        if self.executor.device_greedy(batch):   # the token chosen on the GPU: no logits copied
            return self._emit(batch, self.executor.decode_tokens(batch))
        constrained = [r.matcher for r in batch]
        # the grammar masks: filled on a helper thread while a GPU runs the step, else after it, where needed
        masker = MaskJob if self._masks_while_stepping else MaskNow
        job = masker(constrained, self.vocab_size) if any(m is not None for m in constrained) else None
        logits = self.executor.decode(batch)
        return self._sample(batch, logits, job.result() if job is not None else None)

    def _sample(self, batch: list[Request], logits: torch.Tensor,
                masks: torch.Tensor | None = None) -> list[StepEvent]:
        if any(r.matcher is not None for r in batch):   # forbidden tokens to -inf where it matters (a copy)
            logits = constrained_logits(logits, [r.matcher for r in batch], [r.params for r in batch],
                                        self.vocab_size, masks)
        res = self.sampler(logits, [r.params for r in batch], [r.prompt_ids for r in batch],
                           [r.output_ids for r in batch], [r.generator for r in batch])
        return self._emit(batch, res.token_ids, res.logprobs)

    def _emit(self, batch: list[Request], tokens: list[int],
              logprobs: list[TokenLogprobs | None] | None = None) -> list[StepEvent]:
        """One new token per request of `batch` (with its logprobs where sampled with them; none for
        the runtime's greedy tokens): the output events they produce, stamped with one time."""
        now = time.perf_counter()
        events: list[StepEvent] = []
        for i, (r, t) in enumerate(zip(batch, tokens)):
            events += self.output.append(r, t, None if logprobs is None else logprobs[i], now)
        return events

    # -- offline loop ---------------------------------------------------------------------------
    def run(self, requests: Iterable[Request]) -> Iterator[list[StepEvent]]:
        """Generate for all requests; yields each step's events until every one is finished."""
        requests = list(requests)
        for r in requests:
            self.check_prompt(r.prompt_ids)
        try:
            for r in requests:
                self.add_request(r)
            while not all(r.finished for r in requests):
                yield self.step()
            if self._pending:
                yield self.step()
        finally:  # a caller that stops iterating (a closed stream) gives its blocks back
            for r in requests:
                if not r.finished:
                    self.abort(r.request_id)
