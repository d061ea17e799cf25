"""One forward step, described once and built in one place.

A step is the new tokens of one or more sequences flattened into a single [T] batch: a whole prompt
chunk per sequence for prefill, one token per sequence for decode, or a sequence's last token and its
guesses as separate decode rows for speculative verification. Every model and runtime consumes a
`StepInput`; every caller (the engine, the speculative proposers, benchmarks) makes one through
`StepBuilder`, which reads write slots and attention reads from the sequence's KV (`SlotSource`,
which `kv.blocks.SequenceKV` satisfies).

This module sits between kv/ and runtime/: it imports torch and nothing of ours.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

import numpy as np
import torch

Read = tuple[int, int] | torch.Tensor     # contiguous slot range [first, last + 1), or gathered slot ids
ReadIds = tuple[int, int] | np.ndarray    # the same with the slot ids in a numpy array (int64)


@dataclass
class SeqSlice:
    """Where one sequence's new tokens sit in the step, and where its cache is."""
    start: int                 # first row of this sequence in the step batch
    length: int                # number of new tokens
    context: int               # tokens in cache after this step (incl. new ones)
    read: Read                 # contiguous slot range or gathered slot ids [context]


@dataclass
class StepInput:
    token_ids: torch.Tensor        # [T] long
    positions: torch.Tensor        # [T] long
    write_slots: torch.Tensor      # [T] long: cache slot of each new token
    seqs: list[SeqSlice]
    logits_rows: torch.Tensor      # rows whose logits are wanted (last token of each sequence)

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    def to(self, device: torch.device) -> StepInput:
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)
        seqs = [SeqSlice(s.start, s.length, s.context, s.read if isinstance(s.read, tuple) else mv(s.read))
                for s in self.seqs]
        return StepInput(mv(self.token_ids), mv(self.positions), mv(self.write_slots), seqs,
                         mv(self.logits_rows))

    def rows(self, lo: int, hi: int) -> StepInput:
        """Rows [lo, hi) of a decode step (one token per sequence) as a step of their own, asking for
        the logits of every row."""
        seqs = [SeqSlice(s.start - lo, 1, s.context, s.read) for s in self.seqs[lo:hi]]
        return StepInput(self.token_ids[lo:hi], self.positions[lo:hi], self.write_slots[lo:hi], seqs,
                         torch.arange(hi - lo))


    def next_decode(self, token_ids: torch.Tensor) -> StepInput:
        """The decode step after this one for the same sequences (one token each, one position
        further), built without the host: `token_ids` may stay on the device. Only for sequences
        in consecutive slots (range reads), as a benchmark lays them out."""
        seqs = []
        for s in self.seqs:
            if not isinstance(s.read, tuple) or s.length != 1:
                raise ValueError("next_decode needs a decode step over contiguous slot ranges")
            first, end = s.read
            seqs.append(SeqSlice(s.start, 1, s.context + 1, (first, end + 1)))
        return StepInput(token_ids, self.positions + 1, self.write_slots + 1, seqs, self.logits_rows)


@dataclass
class DecodeRows:
    """A decode step (one new token per sequence, every row's output wanted) as plain lists of Python
    ints. A runtime whose step runs on the host takes it through `forward_rows` and fills its own arrays
    in place: on the 2-core Xeon the tensors of a `StepInput`, their conversions and slices cost ~0.18 ms
    per batch-1 token, 6% of it (benchmarks/host_overhead.py: 0.30 -> 0.12 ms)."""
    token_ids: list[int]
    positions: list[int]
    write_slots: list[int]
    reads: list[ReadIds]       # each row's context, its own token included: a slot range or slot ids

    def step(self) -> StepInput:
        """The same step as a `StepInput`."""
        reads = [r if isinstance(r, tuple) else torch.from_numpy(r) for r in self.reads]
        seqs = [SeqSlice(i, 1, p + 1, r) for i, (p, r) in enumerate(zip(self.positions, reads))]
        return StepInput(torch.tensor(self.token_ids, dtype=torch.long), torch.tensor(self.positions, dtype=torch.long),
                         torch.tensor(self.write_slots, dtype=torch.long), seqs, torch.arange(len(self.token_ids)))


class SlotSource(Protocol):
    """A sequence's place in a KV cache (`kv.blocks.SequenceKV`, or `ContiguousSlots`)."""
    def slot(self, pos: int) -> int: ...
    def slots(self, start: int, end: int) -> torch.Tensor: ...
    def read_slots(self, end: int) -> Read: ...
    def read_ids(self, end: int) -> ReadIds: ...


class ContiguousSlots:
    """A sequence whose tokens sit in consecutive cache slots from `base` (benchmarks, static layouts)."""

    def __init__(self, base: int):
        self.base = base

    def slot(self, pos: int) -> int:
        return self.base + pos

    def slots(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(self.base + start, self.base + end)

    def read_slots(self, end: int) -> Read:
        return (self.base, self.base + end)

    def read_ids(self, end: int) -> ReadIds:
        return (self.base, self.base + end)


Logits = Literal["last", "all", "none"]


class StepBuilder:
    """Accumulates the sequences of one step, then `build()`s it.

        b = StepBuilder()
        b.add(seq_a, prompt_chunk, start=0)                 # prefill chunk: logits of its last token
        b.add(seq_b, [last_token], start=pos)               # decode: one token at `pos`
        b.add(seq_c, [last] + guesses, start=pos, as_rows=True, logits="all")   # verification rows
        step = b.build()
    """

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._positions: list[int] = []
        self._slots: list[torch.Tensor] = []
        self._seqs: list[SeqSlice] = []
        self._rows: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self._tokens)

    def add(self, seq: SlotSource, tokens: Sequence[int] | torch.Tensor, start: int, *,
            logits: Logits = "last", as_rows: bool = False, gather: bool = False) -> int:
        """`tokens` at positions start, start + 1, ... of `seq` (whose slots must be reserved).
        One slice attending causally over the sequence's cache, or with `as_rows` one decode row per
        token (row j sees the context up to its own position: speculative verification). `logits`:
        which of these rows' logits the step returns. `gather` reads the context through gathered slot
        ids even where it is contiguous. Returns the first row."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        n = len(ids)
        if n == 0:
            raise ValueError("a step slice needs at least one token")
        row = len(self._tokens)
        end = start + n
        self._tokens += ids
        self._positions += range(start, end)
        self._slots.append(seq.slots(start, end))

        def read(ctx: int) -> Read:
            return seq.slots(0, ctx) if gather else seq.read_slots(ctx)
        if as_rows:
            self._seqs += [SeqSlice(row + j, 1, start + j + 1, read(start + j + 1)) for j in range(n)]
        else:
            self._seqs.append(SeqSlice(row, n, end, read(end)))
        if logits == "last":
            self._rows.append(row + n - 1)
        elif logits == "all":
            self._rows += range(row, row + n)
        return row

    def build(self) -> StepInput:
        if not self._tokens:
            raise ValueError("an empty step")
        slots = self._slots[0] if len(self._slots) == 1 else torch.cat(self._slots)
        return StepInput(torch.tensor(self._tokens), torch.tensor(self._positions), slots, self._seqs,
                         torch.tensor(self._rows, dtype=torch.long))


def prefill_step(seq: SlotSource, tokens: Sequence[int] | torch.Tensor, start: int = 0, *,
                 logits: Logits = "last", gather: bool = False) -> StepInput:
    """One sequence's tokens at positions start, start + 1, ... as one step."""
    b = StepBuilder()
    b.add(seq, tokens, start, logits=logits, gather=gather)
    return b.build()


def decode_rows(seqs: Sequence[SlotSource], tokens: Sequence[int], positions: Sequence[int]) -> DecodeRows:
    """One decode step as `DecodeRows`: token i at position i of sequence i (`decode_step`'s rows)."""
    return DecodeRows(list(tokens), list(positions), [s.slot(p) for s, p in zip(seqs, positions)],
                      [s.read_ids(p + 1) for s, p in zip(seqs, positions)])


def decode_step(seqs: Sequence[SlotSource], tokens: Sequence[int], positions: Sequence[int], *,
                gather: bool = False) -> StepInput:
    """One decode step: token i at position i of sequence i, asking for every row's logits."""
    b = StepBuilder()
    for s, t, p in zip(seqs, tokens, positions):
        b.add(s, [t], p, gather=gather)
    return b.build()
