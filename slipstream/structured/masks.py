"""Token bitmasks for the constrained rows of a batch, and their application to logits.

A bitmask row holds one bit per vocabulary entry (int32 words, bit t%32 of word t//32, llguidance's
layout). `fill_masks` fills the rows of the requests that carry a matcher; `MaskJob` does the same
on a helper thread so that the masks are computed while a GPU runs the decode step (the grammar
library releases the GIL); `apply_masks` sets the forbidden logits of those rows to -inf.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch


def words(vocab: int) -> int:
    return (vocab + 31) // 32


def fill_masks(matchers: Sequence[Any], vocab: int) -> torch.Tensor:
    """An int32 [len(matchers), words(vocab)] bitmask; rows of None matchers allow everything."""
    out = torch.full((len(matchers), words(vocab)), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill(out[i])
    return out


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
    """Forbidden tokens of `logits` rows set to -inf, in place; row i of `bitmask` masks `rows[i]`
    (default: row i). Columns past the bitmask's width are forbidden. `logits` is a CPU float32
    tensor; the work is done in numpy on this thread: torch's intra-op threads would compete with
    the CPU runtime's spinning thread team right after a decode step (measured: 9 ms per op)."""
    rows = list(range(bitmask.shape[0])) if rows is None else list(rows)
    if not rows:
        return logits
    a = logits.numpy()
    vocab = a.shape[-1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")   # [R, 32 * words]
    for r, i in enumerate(rows):
        forbidden = bits[r, :vocab] == 0
        a[i, :forbidden.shape[0]][forbidden] = -np.inf
        a[i, forbidden.shape[0]:] = -np.inf
    return logits


def masked_copy(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """A float32 CPU copy of `logits` with `apply_masks` applied (numpy copy: see apply_masks)."""
    return apply_masks(torch.from_numpy(logits.detach().float().cpu().numpy().copy()), bitmask, rows)


class MaskJob:
    """`fill_masks` on a helper thread: start it before the model step, `result()` after. Worth it when
    the model step leaves the CPU free (a GPU runtime); the CPU runtime's thread team has every core,
    where a third busy thread only slows the step down (measured on the 2-core CPU: 37 vs 47 tok/s)."""

    _pool: ThreadPoolExecutor | None = None

    def __init__(self, matchers: Sequence[Any], vocab: int):
        if MaskJob._pool is None:
            MaskJob._pool = ThreadPoolExecutor(1, thread_name_prefix="slipstream-masks")
        self._future = MaskJob._pool.submit(fill_masks, list(matchers), vocab)

    def result(self) -> torch.Tensor:
        return self._future.result()


class MaskNow:
    """The masks filled at once, on this thread (the CPU runtime's case); same face as MaskJob."""

    def __init__(self, matchers: Sequence[Any], vocab: int):
        self._out = fill_masks(matchers, vocab)

    def result(self) -> torch.Tensor:
        return self._out
