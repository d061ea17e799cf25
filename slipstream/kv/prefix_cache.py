"""Prefix reuse by chained block hashes.

Every *full* block of computed KV is registered under a hash of its tokens chained with the hash
of the block before it, so a hash names the whole prefix up to the block's end. A new sequence
walks its prompt block by block and takes every block found (sharing it, reference-counted)
until the first miss; only the rest of the prompt is computed. A repeated system prompt or the
history of a multi-turn conversation is therefore computed once. Generated tokens are registered
too, so turn N+1 of a chat finds turn N's answer in the cache.

Hashes are Python's tuple hash (deterministic for ints, 64 bits); a collision would need two
different prefixes with equal 64-bit hashes, which we accept, as vLLM does with its default hash.
"""
from __future__ import annotations

from typing import Sequence

from slipstream.kv.blocks import HybridKVCache, LatentKVCache, PagedKVCache, SequenceKV


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


class PrefixCache:
    def __init__(self, cache: PagedKVCache | LatentKVCache, enabled: bool = True):
        self.cache = cache
        self.enabled = enabled
        self.queried_tokens = 0   # prompt tokens looked up
        self.hit_tokens = 0       # of those, found in the cache

    def match(self, seq: SequenceKV, token_ids: Sequence[int], limit: int, count: bool = True) -> int:
        """Attach the cached blocks that hold a prefix of token_ids[:limit] to an empty sequence.

        Returns how many tokens are now already computed (a multiple of the block size). With
        count=False (a preempted request coming back) the lookup is left out of the hit-rate counters.
        """
        assert not seq.block_table, "prefix matching starts from an empty sequence"
        if count:
            self.queried_tokens += limit
        if not self.enabled:
            return 0
        bs, alloc = self.cache.block_size, self.cache.allocator
        parent = None
        for i in range(limit // bs):
            h = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            b = alloc.block_of.get(h)
            if b is None:
                break
            alloc.share(b)
            seq.block_table.append(b)
            parent = h
        if isinstance(self.cache, HybridKVCache):
            parent = self._trim_to_local_parts(seq, parent)
        n = len(seq.block_table)
        seq.num_hashed_blocks = n
        seq.num_tokens = n * bs
        seq.last_hash = parent
        if count:
            self.hit_tokens += n * bs
        return n * bs

    def _trim_to_local_parts(self, seq: SequenceKV, parent: int | None) -> int | None:
        """A hybrid cache: the sliding layers of the tokens after a hit read the hit's last window, so
        the hit ends where every block of that window still has its local part (the longest such hit;
        none at all is always possible). The sequence holds those parts; the blocks past the end go
        back. Returns the hash of the hit's last block."""
        cache, bs = self.cache, self.cache.block_size
        assert isinstance(cache, HybridKVCache)
        table = seq.block_table

        def first_seen(n: int) -> int:   # the first block the token at position n * bs can see
            return max(0, (n * bs - cache.local_window + 1) // bs)
        n = len(table)
        while n > 0 and not all(cache.has_part(b) for b in table[first_seen(n):n]):
            n -= 1
        if n < len(table):
            cache.allocator.free(table[n:])
            del table[n:]
            parent = cache.allocator.hash_of.get(table[-1]) if table else None
        for b in table[first_seen(n):]:
            cache.hold_part(b)
        seq.num_unheld = first_seen(n)
        return parent

    def commit(self, seq: SequenceKV, token_ids: Sequence[int]) -> None:
        """Register the sequence's newly completed full blocks (token_ids covers its computed tokens)."""
        if not self.enabled:
            return
        bs, alloc = self.cache.block_size, self.cache.allocator
        full = seq.num_tokens // bs
        for i in range(seq.num_hashed_blocks, full):
            h = block_hash(seq.last_hash, token_ids[i * bs:(i + 1) * bs])
            alloc.register(seq.block_table[i], h)
            seq.last_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
