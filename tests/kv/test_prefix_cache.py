"""Block allocator reference counts and the chained-hash prefix cache, without a model."""
from __future__ import annotations

import pytest

from slipstream.kv.blocks import BlockAllocator, OutOfBlocks, PagedKVCache, SequenceKV
from slipstream.kv.prefix_cache import PrefixCache, block_hash


def cache(blocks: int = 8, bs: int = 4) -> PagedKVCache:
    return PagedKVCache(1, blocks, bs, 1, 2)


def test_allocator_hands_out_low_ids_and_counts_references():
    a = BlockAllocator(4)
    assert a.allocate(2) == [0, 1]
    a.share(1)
    a.free([0, 1])
    assert a.num_free == 3 and a.ref_count[1] == 1
    a.free([1])
    assert a.num_free == 4 and a.num_in_use == 0
    assert a.allocate(3) == [0, 1, 2]          # consecutive again after frees
    with pytest.raises(OutOfBlocks):
        a.allocate(2)


def test_unreferenced_cached_blocks_are_recycled_least_recently_used_first():
    a = BlockAllocator(3)
    b = a.allocate(3)
    for i, blk in enumerate(b):
        a.register(blk, 100 + i)
    a.free([b[1]])
    a.free([b[0]])
    a.free([b[2]])
    assert a.num_free == 3 and a.num_in_use == 0   # cached but not in use
    a.share(b[0])                                  # found again by a lookup: back in use
    assert a.num_free == 2
    assert a.allocate(1) == [b[1]]                 # the oldest unreferenced one goes first
    assert 101 not in a.block_of and b[1] not in a.hash_of
    assert a.block_of[100] == b[0]


def test_a_duplicate_block_does_not_replace_the_cached_one():
    a = BlockAllocator(2)
    x, y = a.allocate(2)
    a.register(x, 5)
    a.register(y, 5)
    assert a.block_of[5] == x and y not in a.hash_of


def test_prefix_match_takes_full_blocks_up_to_the_first_difference():
    kv = cache()
    pc = PrefixCache(kv)
    first = SequenceKV(kv)
    toks = list(range(10))                     # 2 full blocks of 4 and a partial one
    first.reserve(10)
    first.num_tokens = 10
    pc.commit(first, toks)
    assert first.num_hashed_blocks == 2
    assert first.last_hash == block_hash(block_hash(None, [0, 1, 2, 3]), [4, 5, 6, 7])

    second = SequenceKV(kv)
    got = pc.match(second, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], limit=10)
    assert got == 8 and second.block_table == first.block_table[:2] and second.num_tokens == 8
    assert kv.allocator.ref_count[first.block_table[0]] == 2

    third = SequenceKV(kv)
    assert pc.match(third, [0, 1, 2, 3, 9, 9, 9, 9], limit=8) == 4   # second block differs
    fourth = SequenceKV(kv)
    assert pc.match(fourth, [9, 1, 2, 3, 4, 5, 6, 7], limit=8) == 0  # the chain starts at block 0
    assert pc.match(SequenceKV(kv), toks, limit=7) == 4              # never past the limit
    assert (pc.queried_tokens, pc.hit_tokens) == (10 + 8 + 8 + 7, 8 + 4 + 0 + 4)


def test_released_sequences_leave_their_blocks_findable_until_recycled():
    kv = cache(blocks=3, bs=4)
    pc = PrefixCache(kv)
    s = SequenceKV(kv)
    s.reserve(8)
    s.num_tokens = 8
    pc.commit(s, list(range(8)))
    s.release()
    assert kv.allocator.num_in_use == 0
    again = SequenceKV(kv)
    assert pc.match(again, list(range(9)), limit=8) == 8
    again.release()
    other = SequenceKV(kv)
    other.reserve(12)                          # needs every block: the cached ones are recycled
    assert pc.match(SequenceKV(kv), list(range(9)), limit=8) == 0


def test_disabled_prefix_cache_matches_nothing():
    kv = cache()
    pc = PrefixCache(kv, enabled=False)
    s = SequenceKV(kv)
    s.reserve(8)
    s.num_tokens = 8
    pc.commit(s, list(range(8)))
    assert pc.match(SequenceKV(kv), list(range(8)), limit=8) == 0
