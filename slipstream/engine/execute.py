"""Step execution: the forward steps of one engine step, and the KV bookkeeping around them.

`StepExecutor` turns scheduled requests into `StepInput`s (through `StepBuilder`), runs them on
the runtime's `Decoder` or the model's eager step, and afterwards advances each sequence's KV length,
registers its full blocks in the prefix cache and, for an MTP proposer, hands it the target's hidden
states of the positions kept. It returns logits (or device-chosen tokens); sampling and output
processing are the engine's next stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slipstream.engine.request import Request
from slipstream.kv.prefix_cache import PrefixCache
from slipstream.models.base import Model
from slipstream.runtime.base import Decoder
from slipstream.runtime.registry import prefill_capacity
from slipstream.step import StepBuilder, StepInput, decode_rows
from slipstream.weights.quant import DENSE_FROM_ROWS, blas_mode, matvec_only

Chunk = tuple[Request, int, int]   # a prompt chunk: (request, start, end)


@dataclass
class PrefillBatch:
    """Prompt chunks computed together in one forward step."""
    chunks: list[Chunk]
    on_runtime: bool = False   # the runtime's own step (one row per token), else the model's eager step
    matvec: bool = False       # eager step through the matvec kernels (short chunks)


class StepExecutor:
    def __init__(self, model: Model, kv: Any, prefix_cache: PrefixCache, runtime: Decoder, proposer: Any):
        self.model = model
        self.kv = kv
        self.prefix_cache = prefix_cache
        self.runtime = runtime
        self.needs_hidden: bool = getattr(proposer, "needs_hidden", False)   # MTP reads the target's states
        self.observer = proposer if self.needs_hidden else None
        self.hidden = torch.empty(0)                 # the last target step's hidden states (MTP only)

    def forward(self, step: StepInput) -> torch.Tensor:
        """The target's step; with an MTP proposer also keeps every row's hidden state."""
        if self.needs_hidden:
            logits, self.hidden = self.model.forward(step, self.kv, return_hidden=True)
            return logits
        return self.runtime.forward(step)

    # -- decode ---------------------------------------------------------------------------------
    def device_greedy(self, batch: list[Request]) -> bool:
        """Plain greedy rows (no penalties, no logprobs) can take the argmax the runtime computed
        on the device: the same token as the host's argmax (lowest index on ties)."""
        return (self.runtime.device_greedy and not self.needs_hidden
                and all(r.params.greedy and not r.params.has_penalties and r.params.logprobs is None
                        and r.matcher is None for r in batch))

    def decode(self, batch: list[Request]) -> torch.Tensor:
        """One decode step of `batch`: the last positions' logits."""
        logits = self._decode(batch, tokens_only=False)
        assert isinstance(logits, torch.Tensor)
        return logits

    def decode_tokens(self, batch: list[Request]) -> list[int]:
        """One decode step of `batch`: the greedy tokens a runtime that selects them itself chose
        (`device_greedy`)."""
        tokens = self._decode(batch, tokens_only=True)
        return tokens if isinstance(tokens, list) else tokens.tolist()

    def _decode(self, batch: list[Request], tokens_only: bool) -> torch.Tensor | list[int]:
        positions = [r.num_tokens - 1 for r in batch]   # the last sampled token is not in the cache yet
        forward_rows = None if self.needs_hidden else getattr(self.runtime, "forward_rows", None)
        out: torch.Tensor | list[int]
        if forward_rows is not None:   # a host runtime: the step as lists, no tensors built
            out = forward_rows(decode_rows([r.seq for r in batch], [r.output_ids[-1] for r in batch], positions),
                               tokens_only=tokens_only)
        else:
            b = StepBuilder()
            for r, pos in zip(batch, positions):
                b.add(r.seq, [r.output_ids[-1]], pos)
            step = b.build()
            out = self.runtime.forward(step, tokens_only=True) if tokens_only else self.forward(step)
        for i, r in enumerate(batch):
            if self.observer is not None:
                self.observer.observe(r, positions[i], self.hidden[i:i + 1])
            r.kv.num_tokens += 1
            self.commit_blocks(r)
        return out

    # -- decode and prompt chunks in one step ---------------------------------------------------
    def can_merge(self, batch: list[Request], chunks: list[Chunk]) -> bool:
        """Whether the decode rows and the prompt chunks fit one step of the runtime's own (its prefill
        capacity): then the weights are read once for both, and a burst of prompts costs the running
        streams only the chunks' extra rows."""
        return (not self.needs_hidden and bool(batch) and bool(chunks)
                and len(batch) + sum(e - s for _, s, e in chunks) <= prefill_capacity(self.runtime))

    def decode_and_prefill(self, batch: list[Request], chunks: list[Chunk], tokens_only: bool = False
                           ) -> tuple[torch.Tensor, list[Request], torch.Tensor]:
        """One runtime step over `batch`'s decode rows and the prompt chunks: the decode rows' logits,
        the requests whose prompt is now complete, and the logits of their last positions (with
        `tokens_only`, the greedy tokens the runtime chose instead of logits)."""
        b = StepBuilder()
        for r in batch:
            b.add(r.seq, [r.output_ids[-1]], r.num_tokens - 1)
        done = []
        for r, start, end in chunks:
            last = end == r.prefill_target and not r.output_ids
            b.add(r.seq, r.all_token_ids[start:end], start, logits="last" if last else "none")
            if last:
                done.append(r)
        logits = self.runtime.forward(b.build(), tokens_only=tokens_only)
        for r in batch:
            r.kv.num_tokens += 1
            self.commit_blocks(r)
        for r, _, end in chunks:
            r.kv.num_tokens = end
            self.commit_blocks(r)
        return logits[:len(batch)], done, logits[len(batch):]

    # -- speculative verification ---------------------------------------------------------------
    def verify(self, batch: list[Request], drafts: list[list[int]]) -> torch.Tensor:
        """One target step over each request's last token and its guesses: logits of every row."""
        b = StepBuilder()
        for r, d in zip(batch, drafts):
            pos = r.num_tokens - 1
            r.kv.reserve(pos + 1 + len(d))
            # each row attends to its own prefix: a decode row
            b.add(r.seq, [r.output_ids[-1]] + d, pos, as_rows=True, logits="all")
        step = b.build()
        with matvec_only():   # the same kernels, row for row, as plain decode steps
            return self.forward(step)

    def keep(self, r: Request, pos: int, row: int, kept: int) -> None:
        """After verification: `r`'s KV holds its token at `pos` and the `kept` guesses after it (the
        rows from `row` on); the newest token goes in next step."""
        r.kv.num_tokens = r.num_tokens - 1
        self.commit_blocks(r)
        if self.observer is not None:   # the rows whose KV the target kept
            self.observer.observe(r, pos, self.hidden[row:row + kept + 1])

    # -- prefill --------------------------------------------------------------------------------
    def prefill_batches(self, chunks: list[Chunk]) -> list[PrefillBatch]:
        """How the planned prompt chunks are batched.

        When their tokens fit the runtime's prefill capacity they go to the runtime's own step, one
        row per token: a burst of prompts no longer stalls the streams behind a slow eager step.
        Otherwise chunks of at least `dense_from_rows` tokens run together through the BLAS path,
        shorter ones together through the matvec kernels: each chunk is computed exactly as it would
        be alone (both paths are row-invariant), so batching never changes a request's tokens.
        """
        if not chunks:
            return []
        if not self.needs_hidden and sum(e - s for _, s, e in chunks) <= prefill_capacity(self.runtime):
            return [PrefillBatch(chunks, on_runtime=True)]
        dense = self.dense_from_rows
        long = [c for c in chunks if c[2] - c[1] >= dense]
        short = [c for c in chunks if c[2] - c[1] < dense]
        return ([PrefillBatch(long)] if long else []) + ([PrefillBatch(short, matvec=True)] if short else [])

    @property
    def dense_from_rows(self) -> int:
        """Prompt chunks of at least this many tokens take the eager step's BLAS products (the runtime's
        `eager_dense_from_rows` where it has one: fewer for 16-bit float weights; else DENSE_FROM_ROWS)."""
        return int(getattr(self.runtime, "eager_dense_from_rows", DENSE_FROM_ROWS))

    def prefill(self, batch: PrefillBatch) -> tuple[list[Request], torch.Tensor]:
        """Compute a batch of prompt chunks: the requests whose prompt is now complete (their next
        token is to be sampled) and the logits of their last positions."""
        if batch.matvec:
            with matvec_only():
                return self._prefill(batch)
        return self._prefill(batch)

    def _prefill(self, batch: PrefillBatch) -> tuple[list[Request], torch.Tensor]:
        b = StepBuilder()
        done = []
        for r, start, end in batch.chunks:
            last = end == r.prefill_target and not r.output_ids   # complete: sample its next token
            b.add(r.seq, r.all_token_ids[start:end], start, logits="last" if last else "none")
            if last:
                done.append(r)
        step = b.build()
        if batch.on_runtime:
            logits = self.runtime.forward(step)
        else:   # the eager step, its BLAS products as the runtime asks (bf16, fixed row blocks; weights.quant)
            with blas_mode(getattr(self.runtime, "eager_blas", "fp32"), self.dense_from_rows):
                logits = self.forward(step) if self.needs_hidden else self.model.forward(step, self.kv).cpu()
        row = 0
        for r, start, end in batch.chunks:
            if self.observer is not None:
                self.observer.observe(r, start, self.hidden[row:row + end - start])
            row += end - start
            r.kv.num_tokens = end
            self.commit_blocks(r)
        return done, logits

    def commit_blocks(self, r: Request) -> None:
        """Register `r`'s newly full blocks in the prefix cache."""
        if r.kv.num_tokens // self.kv.block_size > r.kv.num_hashed_blocks:
            self.prefix_cache.commit(r.seq, r.all_token_ids)
