"""Fixed shapes for the GPU runtimes: batch and context buckets, and the decode step cut to fit.

A captured graph or a compiled plan has a fixed batch (padded rows fill the rest) and a fixed
maximum context, which sets how many attention splits it runs. One maximum for every step would
make a short chat pay for 128k-token attention grids (mostly empty programs, but launched and
merged all the same), so contexts are bucketed too: (batch bucket, context bucket) selects the
graph or plan. A step with more rows than the largest batch bucket (speculative verification:
K + 1 rows per sequence) runs as several replays in order; rows are independent, and each row's
KV is written before any later replay reads it.
"""
from __future__ import annotations

from typing import Any, ClassVar, Iterator

import torch

from slipstream.step import StepInput

CONTEXT_BUCKETS = (512, 2048, 8192, 32768, 131072)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= max_batch."""
    out = [1]
    while out[-1] < max_batch:
        out.append(out[-1] * 2)
    return out


def context_buckets(max_context: int) -> list[int]:
    """The standard buckets below `max_context`, then `max_context` itself."""
    return [c for c in CONTEXT_BUCKETS if c < max_context] + [max_context]


def bucket_for(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def split_rows(step: StepInput, rows: int) -> Iterator[StepInput]:
    """The decode step (one token per sequence) in pieces of at most `rows` sequences, in order;
    each piece asks for the logits of all its rows."""
    n = step.num_rows
    for lo in range(0, n, rows):
        yield step.rows(lo, min(lo + rows, n))


class BucketedDecoder:
    """What the graph and megakernel runtimes share: the (batch, context) buckets, one set of
    static buffers per bucket built on first use (`static`), and the engine-facing `forward`.
    Subclasses provide `_build(batch, context)`, `fill`, `replay` and `logits_of`."""

    name: ClassVar[str]
    device_greedy: ClassVar[bool] = True   # `forward(..., tokens_only=True)`: the argmax taken on the device

    def _init_buckets(self, model, kv, max_batch: int, max_rows: int, max_context: int | None) -> None:
        self.max_context = min(max_context or model.cfg.max_position_embeddings, kv.capacity_tokens)
        self.buckets = batch_buckets(min(max_batch, max_rows))
        self.max_rows = self.buckets[-1]
        self.context_buckets = context_buckets(self.max_context)
        self._static: dict[tuple[int, int], object] = {}

    def static(self, batch: int, context: int | None = None):
        """The buffers of the smallest buckets holding `batch` sequences of at most `context` tokens
        (default: the longest context), built on first use."""
        key = (bucket_for(self.buckets, batch), bucket_for(self.context_buckets, context or self.max_context))
        if key not in self._static:
            self._static[key] = self._build(*key)
        return self._static[key]

    def _build(self, batch: int, context: int) -> Any:
        raise NotImplementedError

    def fill(self, s: Any, step: StepInput) -> None:
        raise NotImplementedError

    def replay(self, s: Any) -> None:
        raise NotImplementedError

    def logits_of(self, s: Any) -> torch.Tensor:
        raise NotImplementedError

    def _check(self, s) -> None:
        """Called after each replay (the megakernel raises on a timed-out wait here)."""

    @torch.inference_mode()
    def forward(self, step: StepInput, tokens_only: bool = False) -> torch.Tensor:
        """Logits (float32, on the CPU) of the step's `logits_rows`, one new token per sequence; with
        `tokens_only` just their greedy tokens (int64, on the CPU), without copying the logits."""
        if any(q.length != 1 for q in step.seqs) or len(step.seqs) != step.token_ids.shape[0]:
            raise ValueError(f"the {self.name} runtime decodes one token per sequence")
        parts = []
        several = step.num_rows > self.max_rows
        for piece in split_rows(step, self.max_rows):
            n = piece.num_rows
            s = self.static(n, max(q.context for q in piece.seqs))
            self.fill(s, piece)
            self.replay(s)
            self._check(s)
            if tokens_only:
                parts.append(s.next_tokens[:n].clone())
            else:   # a later piece in the same bucket replays over these buffers: keep a copy
                logits = self.logits_of(s)[:n]
                parts.append(logits.clone() if several else logits)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = out.index_select(0, step.logits_rows.to(out.device)).cpu()
        return out if tokens_only else out.float()
