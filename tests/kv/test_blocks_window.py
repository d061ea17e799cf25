"""A model whose every layer attends over its last `window` positions gives back the blocks that no
later token can see (`SequenceKV.drop_outside_window`)."""
from __future__ import annotations

import torch

from slipstream.kv.blocks import PagedKVCache, SequenceKV


def _cache(window: int | None, blocks: int = 16, bs: int = 4) -> PagedKVCache:
    kv = PagedKVCache(num_layers=2, num_blocks=blocks, block_size=bs, num_kv_heads=1, head_dim=4)
    kv.k.fill_(float("nan"))   # stale contents: the spare block must not show them
    kv.v.fill_(float("nan"))
    kv.window = window
    return kv


def test_no_window_keeps_every_block():
    kv = _cache(None)
    seq = SequenceKV(kv)
    seq.reserve(40)
    seq.num_tokens = 40
    assert seq.drop_outside_window() == 0 and kv.allocator.num_in_use == 10


def test_blocks_wholly_before_the_window_go_back_and_point_to_a_zeroed_spare():
    kv = _cache(6)
    seq = SequenceKV(kv)
    seq.reserve(12)
    seq.num_tokens = 12   # next token at 12 sees 7..12: block 1 (4..7) is needed, block 0 is kept as slack
    assert seq.drop_outside_window() == 0
    seq.reserve(30)
    seq.num_tokens = 30   # sees 25..30: blocks 0..5 are out; one block of slack keeps 5
    table_before = list(seq.block_table)
    assert seq.drop_outside_window() == 5
    spare = kv.spare_block()
    assert seq.block_table[:5] == [spare] * 5 and seq.block_table[5:] == table_before[5:]
    assert spare not in table_before
    # in use: the sequence's 3 remaining blocks and the spare
    assert kv.allocator.num_in_use == 3 + 1
    rows = slice(spare * 4, spare * 4 + 4)
    assert torch.equal(kv.k[:, rows], torch.zeros_like(kv.k[:, rows]))
    assert torch.equal(kv.v[:, rows], torch.zeros_like(kv.v[:, rows]))
    # positions past the window still map where they did; dropped ones read the spare's zeros
    assert seq.slots(20, 30).tolist() == [table_before[p // 4] * 4 + p % 4 for p in range(20, 30)]
    assert seq.slots(0, 4).tolist() == [spare * 4 + p for p in range(4)]
    assert seq.drop_outside_window() == 0   # nothing new until the sequence moves on
    seq.release()   # frees only the sequence's own blocks: the spare stays held
    assert kv.allocator.num_in_use == 1 and seq.num_dropped == 0


def test_two_sequences_share_one_spare():
    kv = _cache(4)
    a, b = SequenceKV(kv), SequenceKV(kv)
    for s in (a, b):
        s.reserve(24)
        s.num_tokens = 24
        s.drop_outside_window()
    assert a.block_table[0] == b.block_table[0] == kv.spare_block()
    assert kv.allocator.ref_count[kv.spare_block()] == 1
