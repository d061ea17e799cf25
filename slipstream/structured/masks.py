"""Token bitmasks for the constrained rows of a batch, and their application to logits.

A bitmask row holds one bit per vocabulary entry (int32 words, bit t%32 of word t//32, llguidance's
layout). `fill_masks` fills the rows of the requests that carry a matcher; `MaskJob` does the same
on a helper thread so that the masks are computed while a GPU runs the decode step (the grammar
library releases the GIL); `apply_masks` / `masked_copy` set the forbidden logits of those rows to -inf;
`constrained_logits` is what the sampler sees: masks filled and applied only for the rows that need them.

Everything here runs in numpy on the calling thread, never in torch ops: on the CPU runtime the engine
thread does this work right after a decode step, and any torch op that goes parallel (an indexing
with a list of rows, a clone, a masked_fill) wakes torch's intra-op threads, which then wait on the
cores the runtime's thread team holds (measured on the 2-core CPU: 5 to 15 ms per op against 20 to
60 us on one thread; a step is ~31 ms).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

_NEG_INF_BITS = np.float32(-np.inf).view(np.int32)
_local = threading.local()


def words(vocab: int) -> int:
    return (vocab + 31) // 32


def fill_masks(matchers: Sequence[Any], vocab: int) -> torch.Tensor:
    """An int32 [len(matchers), words(vocab)] bitmask; rows of None matchers allow everything."""
    out = np.full((len(matchers), words(vocab)), -1, dtype=np.int32)
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill(out[i])
    return torch.from_numpy(out)


def _words_of(bitmask: torch.Tensor | np.ndarray) -> np.ndarray:
    return bitmask.numpy() if isinstance(bitmask, torch.Tensor) else np.asarray(bitmask)


def _scratch(n: int) -> np.ndarray:
    """An int32 buffer of n words kept per thread (a fresh ~200 KB array per row costs page faults)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.shape[0] < n:
        buf = _local.buf = np.empty(n, dtype=np.int32)
    return buf[:n]


def _mask_row(row: np.ndarray, words: np.ndarray) -> None:
    """The tokens `words` (int32 [W]) forbids set to -inf in the float32 `row` [V], in place; tokens
    past the words' width are forbidden. Integer operations over the whole row (keep the bits of an
    allowed logit, or write -inf's) rather than np.where / boolean indexing, which branch per element
    (~1 ms for 8 x 49k logits against ~0.3 ms)."""
    v = row.view(np.int32)
    bits = np.unpackbits(np.ascontiguousarray(words, dtype=np.int32).view(np.uint8), bitorder="little")
    n = min(v.shape[0], bits.shape[0])
    m = _scratch(n)
    np.subtract(0, bits[:n], out=m, dtype=np.int32)    # -1 (all bits set) allowed, 0 forbidden
    # (v & m) | (-inf & ~m), as ((v ^ -inf) & m) ^ -inf: three passes over the row
    np.bitwise_xor(v[:n], _NEG_INF_BITS, out=v[:n])
    np.bitwise_and(v[:n], m, out=v[:n])
    np.bitwise_xor(v[:n], _NEG_INF_BITS, out=v[:n])
    v[n:] = _NEG_INF_BITS


def _pairs(n_logits: int, bitmask: np.ndarray, rows: Sequence[int] | None) -> tuple[list[int], np.ndarray]:
    """(rows to mask, their bitmask rows in that order). `bitmask` has one row per logits row, or one
    per entry of `rows` (both read the same when every row is masked)."""
    if rows is None:
        rows = range(bitmask.shape[0])
    rows = list(rows)
    if bitmask.shape[0] == n_logits:
        return rows, bitmask if len(rows) == n_logits else bitmask[rows]
    if bitmask.shape[0] == len(rows):
        return rows, bitmask
    raise ValueError(f"a bitmask of {bitmask.shape[0]} rows for {n_logits} logits rows, {len(rows)} of them masked")


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor | np.ndarray,
                rows: Sequence[int] | None = None) -> torch.Tensor:
    """Forbidden tokens of `logits` rows set to -inf, in place, and returned. `bitmask` has one row per
    logits row (row i masks logits row i) or one per entry of `rows` (row i masks `rows[i]`); `rows`
    defaults to every bitmask row. Columns past the bitmask's width are forbidden. `logits` is a
    CPU float32 tensor."""
    a = logits.numpy()
    rows, bm = _pairs(a.shape[0], _words_of(bitmask), rows)
    for r, words in zip(rows, bm):
        _mask_row(a[r], words)
    return logits


def masked_copy(logits: torch.Tensor, bitmask: torch.Tensor | np.ndarray, rows: Sequence[int]) -> torch.Tensor:
    """A float32 CPU copy of `logits` with `apply_masks` applied."""
    out = logits.detach().float().cpu().numpy().copy()
    rows, bm = _pairs(out.shape[0], _words_of(bitmask), rows)
    for r, words in zip(rows, bm):
        _mask_row(out[r], words)
    return torch.from_numpy(out)


def _plain_greedy(p: Any) -> bool:
    return bool(p.greedy and not p.has_penalties and p.logprobs is None)


def constrained_logits(logits: torch.Tensor, matchers: Sequence[Any], params: Sequence[Any], vocab: int,
                       masks: torch.Tensor | np.ndarray | None = None) -> torch.Tensor:
    """The logits a batch samples from: the rows with a matcher (row i: `matchers[i]`, sampled by
    `params[i]`) with the tokens their grammar forbids at -inf, in a copy (the caller's tensor is left
    alone); `logits` itself when no row needs masking. `masks` (one row per logits row), where given,
    are the masks already filled (on a helper thread while a GPU ran the step); else they are filled
    here, only for the rows that need one.

    A greedy row (no penalties, no logprobs) whose own best token the grammar surely allows needs no
    mask: the best allowed token is that token (the lowest index among equal maxima, as the argmax
    of the masked row). On the 135M model writing JSON that holds for ~88% of the rows, and the
    check (~3 us) replaces a mask (~150 us for JSON string contents) and its application."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    given = None if masks is None else _words_of(masks)
    a = logits.detach().float().cpu().numpy()
    quick = [i for i in rows if _plain_greedy(params[i])]
    need = [i for i in rows if not _plain_greedy(params[i])]
    if quick:
        best = (a if len(quick) == a.shape[0] else a[quick]).argmax(axis=1).tolist()
        for i, t in zip(quick, best):
            if given is not None:
                sure = bool(int(given[i, t >> 5]) >> (t & 31) & 1) if (t >> 5) < given.shape[1] else False
            else:
                sure = matchers[i].surely_allows(t)
            if not sure:
                need.append(i)
    if not need:
        return logits
    need.sort()
    if given is None:
        given = fill_masks([matchers[i] for i in need], vocab).numpy()
    return masked_copy(logits, given, need)


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
    """The CPU runtime's case, same face as MaskJob: nothing is filled before the step (work beside
    the step's thread team only slows it down); `result()` is None, and `constrained_logits` fills
    after the step the masks that the step's rows turn out to need."""

    def __init__(self, matchers: Sequence[Any], vocab: int):
        pass

    def result(self) -> torch.Tensor | None:
        return None
