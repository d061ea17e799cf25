"""Speculative decoding in the engine: ask the proposer for guesses, verify them in one target step.

`Speculation.propose` decides how many guesses each running request may carry this step (none for
a batch too large for speculation to pay, a seeded sampled request, or no KV room) and asks the
proposer; `Speculation.verify` runs one target step over every request's last token and its
guesses and walks the rows, keeping the prefix of guesses the target agrees with (the maths,
greedy and rejection sampling, is speculative.verify_row).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from slipstream.engine.execute import StepExecutor
from slipstream.engine.output import OutputProcessor, StepEvent
from slipstream.engine.request import Request
from slipstream.engine.sampling import logprobs
from slipstream.engine.speculative import SpecStats, verify_row
from slipstream.structured.masks import fill_masks, masked_copy


@dataclass
class Proposal:
    drafts: list[list[int]]    # the guesses of each request of the batch (possibly none)
    qs: list[list | None]      # the distributions they were drawn from (None: point masses)


class Speculation:
    def __init__(self, proposer: Any, executor: StepExecutor, output: OutputProcessor, stats: SpecStats,
                 max_batch: int, max_model_len: int, vocab_size: int):
        self.proposer = proposer
        self.executor = executor
        self.output = output
        self.stats = stats
        self.max_batch = max_batch            # past this many running sequences: plain decoding
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def propose(self, batch: list[Request]) -> Proposal | None:
        """Guesses per request, or None when this step decodes plainly (no proposer, a batch too
        large for speculation to pay, or nothing to guess)."""
        if self.proposer is None or len(batch) > self.max_batch:
            return None
        kv = self.executor.kv
        bs, free = kv.block_size, kv.allocator.num_free
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
        return Proposal(drafts, qs) if any(drafts) else None

    def verify(self, batch: list[Request], proposal: Proposal) -> list[StepEvent]:
        """One target step over each request's last token and its guesses, then keep the prefix
        of guesses the target agrees with; the events of the tokens produced."""
        drafts, qs = proposal.drafts, proposal.qs
        positions = [r.num_tokens - 1 for r in batch]
        logits = self.executor.verify(batch, drafts)
        now = time.perf_counter()
        events: list[StepEvent] = []
        spec = self.stats
        row = 0
        for r, pos, d, q in zip(batch, positions, drafts, qs):
            base = row
            row += len(d) + 1
            kept = 0
            if d:
                spec.verifications += 1
                spec.drafted += len(d)
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
                events += self.output.append(r, tok, lp, now)
                if not ok or r.finished:
                    break
                kept += 1
                spec.accepted_at[j] += 1
            if d:
                spec.accepted += kept
                spec.emitted += len(r.output_ids) - before
            self.executor.keep(r, pos, base, kept)
            self.proposer.verified(r)
        return events
