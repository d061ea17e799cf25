"""The generation loop: continuous batching over a paged, prefix-cached KV store.

`add_request` queues a request (or merges it into an identical one in flight); every `step()` asks
the scheduler which requests run, executes one decode batch (one new token for every running
sequence, through the native CPU step where it applies) and one batch of prompt chunks (eager
path), samples, and returns what each request produced, so callers can stream. Requests join and
leave the batch at every step. The engine is single-threaded: the server drives it from one
thread (server/async_engine.py), the offline API through `run()`.

Request merging: two requests in flight with the same prompt tokens and the same sampling
parameters, where sampling is deterministic (greedy, or seeded), would produce the same tokens.
The second one becomes a *follower* of the first: it is never scheduled, and every event of the
first is copied to it. If the first one's caller leaves, the computation goes on for the others.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from slipstream.engine.config import EngineConfig
from slipstream.engine.request import Request
from slipstream.engine.sampling import Sampler, TokenLogprobs, logprobs, make_generator
from slipstream.engine.scheduler import Scheduler, StepPlan
from slipstream.engine.speculative import SpecStats, make_proposer, verify_row
from slipstream.errors import PromptTooLongError, SlipstreamError
from slipstream.kv.prefix_cache import PrefixCache
from slipstream.models.base import Model
from slipstream.runtime.base import Decoder, DecoderOptions
from slipstream.runtime.registry import build_decoder, placement, prefill_capacity, resolve_runtime
from slipstream.step import StepBuilder, StepInput
from slipstream.structured.constraint import ConstraintError
from slipstream.structured.grammar import Matcher, compile_constraint
from slipstream.structured.masks import MaskJob, MaskNow, fill_masks, masked_copy
from slipstream.weights.quant import DENSE_FROM_ROWS, matvec_only

KV_BUDGET_BYTES = 1 << 30   # KV-cache size when not given: up to twice the context, within this


@dataclass
class StepEvent:
    request: Request
    text: str              # newly final text (stop strings are never part of it)
    token_ids: list[int]   # tokens added to the output by this event
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token when asked for


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
        kv_cache_tokens = config.kv_cache_tokens
        if kv_cache_tokens is None:
            per_token = model.kv_bytes_per_token()
            kv_cache_tokens = max(self.max_model_len, min(2 * self.max_model_len, KV_BUDGET_BYTES // per_token))
        self.runtime_name = resolve_runtime(config.runtime, model)
        device = placement(self.runtime_name, model)
        if model.device.type != device:
            model.to(device)
        block_size = config.block_size
        self.kv = model.new_kv_cache(-(-kv_cache_tokens // block_size), block_size)
        self.prefix_cache = PrefixCache(self.kv, enabled=config.enable_prefix_cache)
        self.scheduler = Scheduler(self.kv, self.prefix_cache, config)
        self.sampler = Sampler()
        self.vocab_size = cfg.vocab_size
        self.runtime: Decoder = build_decoder(
            self.runtime_name, model, self.kv,
            DecoderOptions(max_rows=config.spec_rows, max_context=self.max_model_len,
                           hints=runtime_hints or {}, exact=config.exact))
        try:
            self.proposer = make_proposer(config.speculative, config.num_speculative_tokens, model, tokenizer)
        except ValueError as e:
            raise SlipstreamError(str(e)) from None
        # grammar masks overlap the decode step only when the model runs off the CPU
        self._masks_while_stepping = model.device.type != "cpu"
        self.spec_max_batch = config.speculative_max_batch
        self.needs_hidden = getattr(self.proposer, "needs_hidden", False)   # MTP reads the target's states
        if self.needs_hidden:
            self.proposer.kv = self.kv
            if self.runtime.name != "eager":
                raise SlipstreamError("MTP speculation needs the eager runtime (it reads hidden states)")
        self.spec = SpecStats(config.num_speculative_tokens)
        self.requests: dict[str, Request] = {}     # in flight, followers included
        self._merge_index: dict[tuple, Request] = {}
        self._pending: list[StepEvent] = []        # produced outside a step, returned by the next
        self.num_merged = 0

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    @property
    def prefill_chunk(self) -> int:
        return self.scheduler.prefill_chunk

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

    @staticmethod
    def _merge_key(r: Request) -> tuple | None:
        p = r.params
        if not (p.greedy or p.seed is not None):
            return None
        return (tuple(r.prompt_ids), repr(p))

    def add_request(self, r: Request) -> None:
        """Queue a request (validated first); raises SlipstreamError subclasses on bad input."""
        self.check_prompt(r.prompt_ids)
        if r.request_id in self.requests:
            raise SlipstreamError(f"request id {r.request_id!r} is already in flight")
        key = self._merge_key(r) if self.config.enable_merging else None
        primary = self._merge_index.get(key) if key is not None else None
        if primary is not None and not primary.finished:
            self._follow(r, primary)
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
        if key is not None:
            self._merge_index[key] = r

    def _matcher(self, r: Request) -> Matcher:
        """The grammar matcher of a constrained request (a bad constraint is the caller's error)."""
        assert r.params.constraint is not None
        try:
            grammar = compile_constraint(self.tokenizer, r.params.constraint, self.vocab_size)
            return Matcher(grammar, self.tokenizer, self.vocab_size)
        except ConstraintError as e:
            raise SlipstreamError(str(e)) from None

    def _follow(self, r: Request, primary: Request) -> None:
        r.merged_into = primary
        primary.followers.append(r)
        self.requests[r.request_id] = r
        self.num_merged += 1
        if r.priority < primary.priority:     # the shared computation runs at its best caller's priority
            self.scheduler.reprioritize(primary, r.priority)
        if primary.metrics.scheduled is not None:
            r.metrics.scheduled = max(primary.metrics.scheduled, r.metrics.arrival)
        if primary.output_ids:   # catch up with what the primary has produced so far
            self._mirror(primary, r)
            self._pending.append(StepEvent(r, primary.text[:primary.emitted], list(primary.output_ids),
                                           list(primary.logprobs) if primary.params.logprobs is not None else []))

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
        primary = r.merged_into
        if primary is not None:
            primary.followers.remove(r)
            if primary.detached and not primary.followers:
                self._drop(primary)
            else:
                self._settle_priority(primary)
        elif r.followers:
            r.finish_reason = None          # keeps computing for the followers
            r.detached = True
            self._settle_priority(r)
        else:
            self._drop(r)

    def _settle_priority(self, primary: Request) -> None:
        """A shared computation runs at the best priority among the callers still waiting for it."""
        callers = [f.priority for f in primary.followers] + ([] if primary.detached else [primary.own_priority])
        best = min(callers, default=primary.own_priority)
        if best != primary.priority:
            self.scheduler.reprioritize(primary, best)

    def _drop(self, r: Request) -> None:
        if r.finish_reason is None:
            r.finish_reason = "abort"
        if self.proposer is not None:
            self.proposer.release(r.request_id)
        self.scheduler.remove(r)
        self.requests.pop(r.request_id, None)
        self._unindex(r)

    def _unindex(self, r: Request) -> None:
        key = self._merge_key(r)
        if key is not None and self._merge_index.get(key) is r:
            del self._merge_index[key]

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
        plan = self.scheduler.schedule()
        for r in plan.out_of_kv:   # a lone sequence has filled the whole cache
            r.finish_reason = "length"
            events += self._emit(r, self._finish_text(r, time.perf_counter()), [], [])
        if plan.decode:
            proposal = self._propose(plan.decode)
            if proposal is not None:
                events += self._decode_speculative(plan.decode, *proposal)
            elif self._device_greedy(plan.decode):   # the token chosen on the GPU: no logits copied
                tokens, now = self._decode(plan.decode, tokens_only=True).tolist(), time.perf_counter()
                for r, t in zip(plan.decode, tokens):
                    events += self._append(r, t, None, now)
            else:
                constrained = [r.matcher for r in plan.decode]
                # the grammar masks: filled on a helper thread while a GPU runs the step, else right here
                masker = MaskJob if self._masks_while_stepping else MaskNow
                job = masker(constrained, self.vocab_size) if any(m is not None for m in constrained) else None
                logits = self._decode(plan.decode)
                events += self._sample(plan.decode, logits, job.result() if job is not None else None)
        if plan.prefill:
            events += self._prefill(plan)
        for r in [r for r in self.scheduler.running if r.finished]:
            self._retire(r)
        return events

    def _retire(self, r: Request) -> None:
        if self.proposer is not None:
            self.proposer.release(r.request_id)
        self.scheduler.remove(r)
        self.requests.pop(r.request_id, None)
        for f in r.followers:
            self.requests.pop(f.request_id, None)
        self._unindex(r)

    def _device_greedy(self, batch: list[Request]) -> bool:
        """Plain greedy rows (no penalties, no logprobs) can take the argmax the runtime computed
        on the device: the same token as the host's argmax (lowest index on ties)."""
        return (self.runtime.device_greedy and not self.needs_hidden
                and all(r.params.greedy and not r.params.has_penalties and r.params.logprobs is None
                        and r.matcher is None for r in batch))

    def _decode(self, batch: list[Request], tokens_only: bool = False) -> torch.Tensor:
        """One decode step of `batch`: last-position logits, or with `tokens_only` the greedy tokens
        from a runtime that selects them on the device."""
        b = StepBuilder()
        positions = [r.num_tokens - 1 for r in batch]   # the last sampled token is not in the cache yet
        for r, pos in zip(batch, positions):
            b.add(r.seq, [r.output_ids[-1]], pos)
        step = b.build()
        logits = self.runtime.forward(step, tokens_only=True) if tokens_only else self._forward(step)
        for i, r in enumerate(batch):
            if self.needs_hidden:
                self.proposer.observe(r, positions[i], self._hidden[i:i + 1])
            r.kv.num_tokens += 1
            self._commit_blocks(r)
        return logits

    def _forward(self, step: StepInput) -> torch.Tensor:
        """The target's step; with an MTP proposer also keeps every row's hidden state."""
        if self.needs_hidden:
            logits, self._hidden = self.model.forward(step, self.kv, return_hidden=True)
            return logits
        return self.runtime.forward(step)

    # -- speculative decoding -------------------------------------------------------------------
    def _propose(self, batch: list[Request]) -> tuple[list[list[int]], list[list | None]] | None:
        """Guesses per request (and the distributions they were drawn from, when not point
        masses), or None when this step decodes plainly (no proposer, a batch too large for
        speculation to pay, or nothing to guess)."""
        if self.proposer is None or len(batch) > self.spec_max_batch:
            return None
        bs, free = self.kv.block_size, self.kv.allocator.num_free
        ks = []
        for r in batch:
            k = min(self.proposer.k, r.params.max_tokens - len(r.output_ids) - 1,
                    self.max_model_len - r.num_tokens - 1)
            if not r.params.greedy and r.params.seed is not None:
                # speculation draws extra random numbers, and whether a step speculates depends on
                # the batch size; a seeded request must draw the same tokens whatever runs beside it
                k = 0
            pos = r.num_tokens - 1
            room = (len(r.kv.block_table) + free) * bs - (pos + 1)    # slots it can get now
            k = max(0, min(k, room))
            free -= r.kv.blocks_needed(pos + 1 + k)
            ks.append(k)
        if not any(ks):
            return None
        drafts, qs = self.proposer.propose_batch(batch, ks)
        drafts = [d[:k] for d, k in zip(drafts, ks)]
        # guesses past the first one the grammar forbids would be rejected anyway: not verified
        drafts = [d[:r.matcher.valid_prefix(d)] if r.matcher is not None and d else d
                  for r, d in zip(batch, drafts)]
        return (drafts, qs) if any(drafts) else None

    def _decode_speculative(self, batch: list[Request], drafts: list[list[int]],
                            qs: list[list | None]) -> list[StepEvent]:
        """One target step over each request's last token and its guesses, then keep the prefix
        of guesses the target agrees with (see speculative.py)."""
        b = StepBuilder()
        base_pos: dict[int, int] = {}
        for r, d in zip(batch, drafts):
            pos = r.num_tokens - 1
            base_pos[id(r)] = pos
            r.kv.reserve(pos + 1 + len(d))
            # each row attends to its own prefix: a decode row
            b.add(r.seq, [r.output_ids[-1]] + d, pos, as_rows=True, logits="all")
        step = b.build()
        with matvec_only():   # the same kernels, row for row, as plain decode steps
            logits = self._forward(step)
        now = time.perf_counter()
        events: list[StepEvent] = []
        row = 0
        for r, d, q in zip(batch, drafts, qs):
            base = row
            row += len(d) + 1
            kept = 0
            if d:
                self.spec.verifications += 1
                self.spec.drafted += len(d)
            before = len(r.output_ids)
            for j in range(len(d) + 1):
                draft = d[j] if j < len(d) else None
                row_logits = logits[base + j]
                if r.matcher is not None:   # the grammar's mask after the tokens kept so far
                    row_logits = masked_copy(row_logits[None], fill_masks([r.matcher], self.vocab_size), [0])[0]
                tok, ok, pen = verify_row(row_logits, r.params, r.prompt_ids, r.output_ids,
                                          r.generator, draft, q[j] if q and draft is not None else None)
                lp = None
                if r.params.logprobs is not None:
                    lp = logprobs(pen[None], [r.params], [tok])[0]
                events += self._append(r, tok, lp, now)
                if not ok or r.finished:
                    break
                kept += 1
                self.spec.accepted_at[j] += 1
            if d:
                self.spec.accepted += kept
                self.spec.emitted += len(r.output_ids) - before
            # KV now holds the last token and the kept guesses; the newest token goes in next step
            r.kv.num_tokens = r.num_tokens - 1
            self._commit_blocks(r)
            if self.needs_hidden:   # the rows whose KV the target kept
                self.proposer.observe(r, base_pos[id(r)], self._hidden[base:base + kept + 1])
            self.proposer.verified(r)
        return events

    def _prefill(self, plan: StepPlan) -> list[StepEvent]:
        """The planned prompt chunks, batched; sample the requests whose prompt is complete.

        Chunks of at least DENSE_FROM_ROWS tokens run together through the BLAS path, shorter
        ones together through the matvec kernels: each chunk is computed exactly as it would be
        alone (both paths are row-invariant), so batching never changes a request's tokens.
        """
        if not self.needs_hidden and sum(e - s for _, s, e in plan.prefill) <= prefill_capacity(self.runtime):
            # small chunks (the prompt tokens beside running decodes) in the runtime's own step, one
            # row per token: a burst of prompts no longer stalls the streams behind a slow eager step
            return self._prefill_group(plan.prefill, self.runtime.forward)
        long = [c for c in plan.prefill if c[2] - c[1] >= DENSE_FROM_ROWS]
        short = [c for c in plan.prefill if c[2] - c[1] < DENSE_FROM_ROWS]
        events = self._prefill_group(long) if long else []
        if short:
            with matvec_only():
                events += self._prefill_group(short)
        return events

    def _prefill_group(self, chunks: list[tuple[Request, int, int]],
                       forward: Callable[[StepInput], torch.Tensor] | None = None) -> list[StepEvent]:
        b = StepBuilder()
        done = []
        for r, start, end in chunks:
            last = end == r.prefill_target and not r.output_ids   # complete: sample its next token
            b.add(r.seq, r.all_token_ids[start:end], start, logits="last" if last else "none")
            if last:
                done.append(r)
        step = b.build()
        if forward is not None:
            logits = forward(step)
        else:
            logits = self._forward(step) if self.needs_hidden else self.model.forward(step, self.kv).cpu()
        row = 0
        for r, start, end in chunks:
            if self.needs_hidden:
                self.proposer.observe(r, start, self._hidden[row:row + end - start])
            row += end - start
            r.kv.num_tokens = end
            self._commit_blocks(r)
        return self._sample(done, logits) if done else []

    def _commit_blocks(self, r: Request) -> None:
        if r.kv.num_tokens // self.kv.block_size > r.kv.num_hashed_blocks:
            self.prefix_cache.commit(r.seq, r.all_token_ids)

    def _sample(self, batch: list[Request], logits: torch.Tensor,
                masks: torch.Tensor | None = None) -> list[StepEvent]:
        rows = [i for i, r in enumerate(batch) if r.matcher is not None]
        if rows:   # forbidden tokens of constrained rows to -inf (a copy: the runtime owns its logits)
            if masks is None:
                masks = fill_masks([r.matcher for r in batch], self.vocab_size)
            logits = masked_copy(logits, masks[rows], rows)
        res = self.sampler(logits, [r.params for r in batch], [r.prompt_ids for r in batch],
                           [r.output_ids for r in batch], [r.generator for r in batch])
        now = time.perf_counter()
        events: list[StepEvent] = []
        for r, t, lp in zip(batch, res.token_ids, res.logprobs):
            events += self._append(r, t, lp, now)
        return events

    def _append(self, r: Request, tok: int, lp: TokenLogprobs | None, now: float) -> list[StepEvent]:
        p = r.params
        if r.metrics.first_token is None:
            r.metrics.first_token = now
        r.output_ids.append(tok)
        r.metrics.num_output_tokens += 1
        if lp is not None:
            r.logprobs.append(lp)
        if r.matcher is not None:
            r.matcher.accept(tok)
        if ((tok in self.tokenizer.eos_token_ids and (not p.ignore_eos or r.matcher is not None))
                or tok in (p.stop_token_ids or ())):
            r.finish_reason = "stop"
        else:
            before = len(r.text)
            r.text += r.detok.add(tok)
            self._check_stop_strings(r, before)
            if r.finish_reason is None and r.matcher is not None and r.matcher.finished:
                r.finish_reason = "stop"   # the grammar is complete and allows nothing more
        if r.finish_reason is None and (len(r.output_ids) >= p.max_tokens or r.num_tokens >= self.max_model_len):
            r.finish_reason = "length"
        return self._emit(r, self._finish_text(r, now), [tok], [lp] if lp is not None else [])

    def _finish_text(self, r: Request, now: float) -> str:
        """Text that became final with this event (flushes the detokenizer when the request ends)."""
        if r.finished:
            if r.finish_reason == "length":
                before = len(r.text)
                r.text += r.detok.flush()
                self._check_stop_strings(r, before)
            r.metrics.finished = now
        end = len(r.text) if r.finished else len(r.text) - self._held_back(r)
        delta = r.text[r.emitted:end] if end > r.emitted else ""
        r.emitted = max(r.emitted, end)
        return delta

    def _emit(self, r: Request, text: str, toks: list[int], lps: list[TokenLogprobs]) -> list[StepEvent]:
        """The event for the request itself (unless its caller left) and a copy for each follower."""
        out = [] if r.detached else [StepEvent(r, text, toks, lps)]
        for f in r.followers:
            self._mirror(r, f)
            out.append(StepEvent(f, text, list(toks), list(lps)))
        return out

    @staticmethod
    def _mirror(r: Request, f: Request) -> None:
        f.output_ids, f.logprobs = r.output_ids, r.logprobs   # shared: the same tokens
        f.text, f.emitted, f.finish_reason = r.text, r.emitted, r.finish_reason
        # a follower that joined late got its first tokens when it joined, not before it arrived
        now = time.perf_counter()
        if f.metrics.first_token is None and r.metrics.first_token is not None:
            f.metrics.first_token = max(r.metrics.first_token, f.metrics.arrival)
        if f.metrics.scheduled is None:
            f.metrics.scheduled = min(now, max(r.metrics.scheduled or now, f.metrics.arrival))
        if r.metrics.finished is not None:
            f.metrics.finished = max(r.metrics.finished, f.metrics.arrival)
        f.metrics.num_output_tokens = r.metrics.num_output_tokens

    @staticmethod
    def _check_stop_strings(r: Request, before: int) -> None:
        for s in r.params.stop or ():
            i = r.text.find(s, max(0, before - len(s) + 1))
            if i >= 0:
                r.text = r.text[:i]
                r.finish_reason = "stop"
                before = min(before, i)

    @staticmethod
    def _held_back(r: Request) -> int:
        """Length of the text's tail that could still become a stop string: not streamed yet."""
        held = 0
        for s in r.params.stop or ():
            for k in range(min(len(s) - 1, len(r.text)), held, -1):
                if r.text.endswith(s[:k]):
                    held = k
                    break
        return held

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
