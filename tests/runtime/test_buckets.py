"""The bucket bookkeeping the graph and megakernel runtimes share (`runtime/buckets.py`), on a fake
runtime whose "replay" writes each row's token id into its logits: no Triton needed."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from slipstream.runtime.buckets import BucketedDecoder
from slipstream.step import ContiguousSlots, decode_step

VOCAB = 4


class _Fake(BucketedDecoder):
    name = "fake"

    def __init__(self, max_batch: int):
        model = SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=64))
        self._init_buckets(model, SimpleNamespace(capacity_tokens=64), max_batch, max_batch, None)
        self.builds = 0

    def _build(self, batch: int, context: int):
        self.builds += 1
        return SimpleNamespace(tokens=torch.zeros(batch, dtype=torch.long),
                               logits=torch.zeros(batch, VOCAB), next_tokens=torch.zeros(batch, dtype=torch.long))

    def fill(self, s, step) -> None:
        s.tokens.zero_()
        s.tokens[:step.num_rows] = step.token_ids

    def replay(self, s) -> None:
        s.logits.copy_(s.tokens[:, None].float().expand(-1, VOCAB))
        s.next_tokens.copy_(s.tokens)

    @staticmethod
    def logits_of(s) -> torch.Tensor:
        return s.logits


def _step(tokens: list[int]):
    return decode_step([ContiguousSlots(16 * i) for i in range(len(tokens))], tokens, [3] * len(tokens))


def test_pieces_in_the_same_bucket_keep_their_own_logits():
    """Three rows past a largest bucket of 1: three replays of one bucket's buffers, in order."""
    dec = _Fake(max_batch=1)
    logits = dec.forward(_step([7, 5, 9]))
    assert dec.builds == 1                      # every piece went to the same (1, context) bucket
    assert logits[:, 0].tolist() == [7.0, 5.0, 9.0]
    assert dec.forward(_step([7, 5, 9]), tokens_only=True).tolist() == [7, 5, 9]


def test_one_piece_pads_to_its_bucket():
    dec = _Fake(max_batch=4)
    assert dec.forward(_step([2, 3, 1]))[:, 0].tolist() == [2.0, 3.0, 1.0]
    assert dec.static(3) is dec.static(4)
