"""Which requests run in the next step, and how much of each prompt gets computed.

Every step the scheduler
1. admits waiting requests (best priority first, FIFO among equals) while the batch has room and
   KV blocks are free, attaching whatever prefix of their prompt the prefix cache already holds;
   a waiting request with a strictly better priority than the worst running one preempts it;
2. gives every decoding request a slot for its next token, preempting the worst running request
   (recompute: its blocks are released, it goes back to the queue keeping its output, and the
   prefix cache usually hands most of its blocks back on re-admission) when blocks run out;
3. hands out a budget of `prefill_chunk` prompt tokens to prefilling requests, so that a long
   prompt is computed over several steps while the running decodes keep producing tokens; in a
   step that also decodes, the budget (and the chunk) is `prefill_budget` when that is smaller, so
   a running stream never waits behind more than `prefill_budget` prompt tokens per token it gets
   (chunked-prefill fairness, as vLLM's and SGLang's per-step token budgets).

Blocks are allocated on demand (prompt chunk by chunk, a block per `block_size` generated tokens),
not reserved up front, so the batch can hold as many sequences as their real lengths allow.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from slipstream.engine.config import EngineConfig
from slipstream.engine.request import Request
from slipstream.errors import QueueFullError
from slipstream.kv.blocks import LatentKVCache, PagedKVCache, SequenceKV
from slipstream.kv.prefix_cache import PrefixCache


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, start, end)
    out_of_kv: list[Request] = field(default_factory=list)  # alone and the cache is full: must stop

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill or self.out_of_kv)


class Scheduler:
    def __init__(self, kv: PagedKVCache | LatentKVCache, prefix_cache: PrefixCache, config: EngineConfig):
        self.kv = kv
        self.alloc = kv.allocator
        self.prefix_cache = prefix_cache
        self.config = config                       # validated: max_batch, prefill_chunk >= 1
        self.max_batch = config.max_batch
        self.prefill_chunk = config.prefill_chunk
        self.prefill_budget = getattr(config, "prefill_budget", None)
        self.max_waiting = config.max_waiting
        self.waiting: list[Request] = []   # sorted by Request.order
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue ----------------------------------------------------------------------------------
    def add(self, r: Request) -> None:
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"the server is overloaded: {len(self.waiting)} requests are already "
                                 "waiting; retry later")
        self._enqueue(r)

    def _enqueue(self, r: Request) -> None:
        keys = [w.order for w in self.waiting]
        self.waiting.insert(bisect.bisect(keys, r.order), r)

    def reprioritize(self, r: Request, priority: int) -> None:
        r.priority = priority
        if r in self.waiting:
            self.waiting.remove(r)
            self._enqueue(r)

    def remove(self, r: Request) -> None:
        """Take a request out of the queue or the batch and free its blocks."""
        if r in self.waiting:
            self.waiting.remove(r)
        if r in self.running:
            self.running.remove(r)
        if r.kv is not None:
            r.kv.release()
            r.kv = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def is_prefilling(r: Request) -> bool:
        return r.kv.num_tokens < r.prefill_target

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        for r in self.running:   # a model whose every layer slides: blocks out of every window go back
            r.kv.drop_outside_window()
        self._admit()
        self._grow_decodes(plan)
        self._plan_prefill(plan)
        if plan.empty and self.running:
            # everything running is a prefill that cannot get a block: make room by preemption
            if len(self.running) > 1:
                self._preempt(self._worst_running())
                self._plan_prefill(plan)
            else:
                plan.out_of_kv.append(self.running[0])
        return plan

    def _worst_running(self) -> Request:
        return max(self.running, key=lambda r: r.order)

    def _admit(self) -> None:
        while self.waiting:
            r = self.waiting[0]
            if len(self.running) >= self.max_batch:
                worst = self._worst_running()
                if r.priority >= worst.priority:
                    return
                self._preempt(worst)        # a latency-class request takes the slot
                continue
            seq = SequenceKV(self.kv)
            tokens = r.all_token_ids
            # a new request must compute at least its last prompt token (its logits are sampled)
            limit = r.prefill_target - (0 if r.output_ids else 1)
            first = r.metrics.scheduled is None     # re-admissions after preemption are not counted
            cached = self.prefix_cache.match(seq, tokens, limit, count=first)
            first_end = min(r.prefill_target, cached + self.prefill_chunk)
            need = seq.blocks_needed(max(first_end, cached + 1))
            headroom = len(self.running)    # a block for each running decode's next step
            if self.running and need + headroom > self.alloc.num_free:
                seq.release()
                if first:   # not admitted: this lookup does not count
                    self.prefix_cache.queried_tokens -= limit
                    self.prefix_cache.hit_tokens -= cached
                return
            self.waiting.pop(0)
            r.kv = seq
            if r.metrics.scheduled is None:
                r.metrics.scheduled = time.perf_counter()
                r.metrics.num_cached_prompt_tokens = cached
            self.running.append(r)

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        r.kv.release()
        r.kv = None
        r.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(r)

    def _grow_decodes(self, plan: StepPlan) -> None:
        for r in sorted((r for r in self.running if not self.is_prefilling(r)), key=lambda r: r.order):
            if r not in self.running:      # preempted below on behalf of a better request
                continue
            need = r.kv.blocks_needed(r.num_tokens)
            while need > self.alloc.num_free and r in self.running:
                if len(self.running) == 1:
                    plan.out_of_kv.append(r)
                    break
                self._preempt(self._worst_running())
            if r in self.running and r not in plan.out_of_kv:
                r.kv.reserve(r.num_tokens)
                plan.decode.append(r)
        plan.decode = [r for r in plan.decode if r in self.running]

    def _plan_prefill(self, plan: StepPlan) -> None:
        """Whole chunks only: a prompt is always cut at the same places (multiples of the chunk
        size after its cached prefix) whatever else runs, so its numbers do not depend on the batch.
        The best-placed request always gets its chunk; others join while the budget lasts. In a step
        that decodes, the chunk is `prefill_budget` when that is smaller (then where a prompt is cut
        depends on whether something was decoding)."""
        chunk = self.prefill_chunk
        if plan.decode and self.prefill_budget is not None:
            chunk = min(chunk, self.prefill_budget)
        budget = chunk
        bs = self.kv.block_size
        for r in sorted((r for r in self.running if self.is_prefilling(r)), key=lambda r: r.order):
            if any(p[0] is r for p in plan.prefill):
                continue
            start = r.kv.num_tokens
            end = start + min(r.prefill_target - start, chunk)
            if end - start > budget:
                continue
            room = (len(r.kv.block_table) + self.alloc.num_free) * bs   # tokens it could hold now
            end = min(end, room)
            if end <= start:
                continue
            r.kv.reserve(end)
            plan.prefill.append((r, start, end))
            budget -= end - start
