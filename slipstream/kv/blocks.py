"""Paged KV cache: fixed-size blocks of token slots, a free list, and a block table per sequence.

K and V for every layer live in two tensors indexed by *slot* (block * block_size + offset), so a
sequence's cache is wherever its block table points. When a sequence's blocks happen to be
consecutive (the common case on a quiet server) attention reads a plain slice instead of gathering.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slipstream.errors import SlipstreamError


class OutOfBlocks(SlipstreamError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.ref_count = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"KV cache full: need {n} blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.ref_count[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self._free.append(b)
        # keep low ids at the end so new sequences get consecutive blocks again
        self._free.sort(reverse=True)


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32):
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        # empty, not zeros: pages are only committed when written, and attention never reads a
        # slot before its token was stored
        self.k = torch.empty(shape, dtype=dtype)
        self.v = torch.empty(shape, dtype=dtype)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return 1.0 - self.allocator.num_free / self.num_blocks


@dataclass
class SequenceKV:
    """The blocks one sequence owns and how many of its slots hold tokens."""
    cache: PagedKVCache
    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def reserve(self, total_tokens: int) -> None:
        bs = self.cache.block_size
        need = -(-total_tokens // bs) - len(self.block_table)
        if need > 0:
            self.block_table += self.cache.allocator.allocate(need)

    def slots(self, start: int, end: int) -> torch.Tensor:
        bs = self.cache.block_size
        pos = torch.arange(start, end)
        table = torch.tensor(self.block_table, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def contiguous_range(self, end: int) -> tuple[int, int] | None:
        """(first slot, last slot + 1) when tokens [0, end) sit in consecutive slots, else None."""
        nb = -(-end // self.cache.block_size)
        t = self.block_table[:nb]
        if t and t[-1] - t[0] == nb - 1 and all(b - a == 1 for a, b in zip(t, t[1:])):
            start = t[0] * self.cache.block_size
            return start, start + end
        return None

    def release(self) -> None:
        self.cache.allocator.free(self.block_table)
        self.block_table = []
        self.num_tokens = 0
