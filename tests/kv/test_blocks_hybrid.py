"""Gemma's hybrid cache (`kv.blocks.HybridKVCache`): the global layers keep every block, the sliding
layers keep a local part per block only while some sequence's window can still see it; prefix hits end
where the window they need still has its parts."""
from __future__ import annotations

import pytest
import torch

from slipstream.kv.blocks import HybridKVCache, SequenceKV
from slipstream.kv.prefix_cache import PrefixCache

BS, WINDOW = 4, 6


def _cache(blocks: int = 16) -> HybridKVCache:
    kv = HybridKVCache([True, False, True], WINDOW, blocks, BS, num_kv_heads=1, head_dim=2)
    kv.k_local[:, :blocks * BS].fill_(float("nan"))   # stale contents: gone parts read as the spare's zeros
    kv.v_local[:, :blocks * BS].fill_(float("nan"))
    return kv


def test_layers_map_to_their_own_storage():
    kv = _cache()
    assert kv.k.shape[0] == 1 and kv.k_local.shape[0] == 2
    assert kv.layer_cache(0)[2] and not kv.layer_cache(1)[2] and kv.layer_cache(2)[2]
    assert kv.layer_cache(2)[0].data_ptr() == kv.k_local[1].data_ptr()
    assert kv.layer_cache(1)[0].data_ptr() == kv.k[0].data_ptr()
    with pytest.raises(ValueError):
        HybridKVCache([True, True], WINDOW, 4, BS, 1, 2)


def test_parts_behind_the_window_go_back_and_the_blocks_stay():
    kv = _cache()
    seq = SequenceKV(kv)
    seq.reserve(40)
    seq.num_tokens = 40       # next token at 40 sees 35..40: blocks 8, 9 (and block 7 as slack)
    assert kv.parts_in_use == 10
    assert seq.drop_outside_window() == 7
    assert kv.allocator.num_in_use == 10 and kv.parts_in_use == 3
    gone = seq.block_table[:7]
    slots = seq.slots(0, 40)
    local = kv.local_slots(slots)
    assert torch.equal(local[:28], torch.tensor([kv.spare_part * BS + i % BS for i in range(28)]))
    assert torch.equal(kv.local_slots((0, 40)), local)    # a slot range translates alike
    assert not any(kv.has_part(b) for b in gone) and all(kv.has_part(b) for b in seq.block_table[7:])
    assert torch.equal(kv.k_local[:, local[:28]], torch.zeros_like(kv.k_local[:, local[:28]]))
    # freed parts are handed out again, lowest first: a new block's part is not its own id
    other = SequenceKV(kv)
    other.reserve(4)
    assert kv.local_of[other.block_table[0]].item() == 0 != other.block_table[0]
    seq.release()
    other.release()
    assert kv.allocator.num_in_use == 0 and kv.parts_in_use == 0


def test_a_new_part_reuses_written_pages_before_touching_new_ones():
    kv = _cache()
    cache = PrefixCache(kv)
    a = SequenceKV(kv)
    a.reserve(40)
    a.num_tokens = 40
    cache.commit(a, list(range(40)))
    a.drop_outside_window()             # blocks 0..6: registered, so their parts are kept (not held)
    assert kv.parts_touched == 10 and kv.parts_held == 3 and kv.parts_in_use == 10
    x = SequenceKV(kv)
    x.reserve(12)                       # three new blocks take back the three oldest kept parts
    assert kv.parts_touched == 10 and [kv.has_part(b) for b in a.block_table[:4]] == [False] * 3 + [True]
    x.release()                         # unregistered: their parts are free, below the touched mark
    y = SequenceKV(kv)
    y.reserve(8)
    assert kv.parts_touched == 10 and all(kv.has_part(b) for b in a.block_table[3:])
    a.release()
    y.release()


def test_a_prefix_hit_ends_where_its_window_still_has_parts():
    kv = _cache()
    cache = PrefixCache(kv)
    tokens = list(range(40))
    a = SequenceKV(kv)
    a.reserve(40)
    a.num_tokens = 40
    cache.commit(a, tokens)
    a.drop_outside_window()
    x = SequenceKV(kv)
    x.reserve(20)                       # five new blocks take back the parts of blocks 0..4
    assert [kv.has_part(b) for b in a.block_table] == [False] * 5 + [True] * 5
    # b wants 36 tokens (9 blocks): the token at 36 sees 31..36, so blocks 7 and 8 must have parts: they do
    b = SequenceKV(kv)
    assert cache.match(b, tokens, 36) == 36 and b.num_unheld == 7
    assert kv.local_ref[a.block_table[8]] == 2
    # c wants 20 tokens: the token at 20 needs block 3's part (gone) and 4's: back to a hit of 0 blocks
    c = SequenceKV(kv)
    assert cache.match(c, tokens, 20) == 0 and c.block_table == []
    # e wants 28: the token at 28 sees 23..28, blocks 5 and 6, whose parts were kept
    e = SequenceKV(kv)
    assert cache.match(e, tokens, 28) == 28 and e.num_unheld == 5
    for s in (x, e, a, b):
        s.release()
    # the last window's parts outlive the sequences (kept): the next turn of the conversation finds them
    assert kv.parts_held == 0 and kv.parts_in_use == 5
    d = SequenceKV(kv)
    assert cache.match(d, tokens, 40) == 40 and d.num_unheld == 8
    d.release()
