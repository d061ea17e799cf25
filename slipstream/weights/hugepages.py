"""Converted weights moved into transparent huge pages.

A decode step streams every weight once. With 4 KB pages that is ~24,000 pages per token for the
default model (96 MB), more than the CPU's second-level TLB holds, so each page costs a page walk; in
2 MB pages the whole model is ~50 entries. Where the kernel gives huge pages on request
(/sys/kernel/mm/transparent_hugepage/enabled is `madvise` or `always`), the weights that loading
converted into memory of their own are copied into one private anonymous mapping advised
MADV_HUGEPAGE, and the copies they came from are freed. Measured on the 2-core Xeon: the batch-1 native
step 0.962-0.974x the time (docs/BENCHMARKS.md). Tensors read in place from the file's memory map are
left where they are: copying them would keep two copies resident.
"""
from __future__ import annotations

import mmap
import os
import sys
from typing import Any

import numpy as np
import torch

from slipstream.weights.quant import Linear, weight_linears

HUGE = 2 << 20          # the x86-64 and arm64 (4 KB granule) huge page
MIN_BYTES = 4 << 20     # below this a huge page or two buys nothing
ALIGN = 64              # as torch's allocator places tensors


def huge_pages_available() -> bool:
    """Linux with transparent huge pages on request (`madvise` or `always`), unless
    SLIPSTREAM_HUGE_PAGES=0."""
    if os.environ.get("SLIPSTREAM_HUGE_PAGES", "1") == "0":
        return False
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


FIELDS = ("data", "scale", "min", "bias", "kq0", "kq1", "kq2")   # kqJ: Linear.kq[J] (a Q4_K matrix's scales)


def _field(lin: Linear, name: str) -> torch.Tensor | None:
    if name.startswith("kq"):
        return None if lin.kq is None else lin.kq[int(name[2:])]
    return getattr(lin, name)


def _set_field(lin: Linear, name: str, t: torch.Tensor) -> None:
    if name.startswith("kq"):
        kq = list(lin.kq or ())
        kq[int(name[2:])] = t
        lin.kq = (kq[0], kq[1], kq[2])
    else:
        setattr(lin, name, t)


def _movable(t: torch.Tensor | None, mapped: tuple[int, int] | None) -> bool:
    if t is None or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return False
    if mapped is not None and mapped[0] <= t.data_ptr() < mapped[0] + mapped[1]:
        return False   # read in place from the file's map
    return True


def move_to_huge_pages(weights: dict[str, Any], mapped: tuple[int, int] | None = None) -> int:
    """Copy the Linears' tensors (codes, scales, mins, biases) that are not inside `mapped` (the file
    map's address and size) into one huge-page mapping, in place on the Linear objects. Returns the
    bytes moved (0 where huge pages are not available or the weights are too small)."""
    if not huge_pages_available():
        return 0
    moves: list[tuple[Linear, str, torch.Tensor]] = []
    total = 0
    for lin in weight_linears(weights):
        for name in FIELDS:
            t = _field(lin, name)
            if _movable(t, mapped):
                moves.append((lin, name, t))
                total += -total % ALIGN + t.numel() * t.element_size()
    if total < MIN_BYTES:
        return 0
    try:
        region = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError, AttributeError):
        return 0
    arena = np.frombuffer(region, np.uint8)
    off = -arena.ctypes.data % HUGE   # start on a huge-page boundary
    for lin, name, t in moves:
        off += -off % ALIGN
        n = t.numel() * t.element_size()
        # numpy copies bytes (loading runs no torch kernel: see `Linear.from_blocks`)
        np.copyto(arena[off:off + n], t.reshape(-1).view(torch.uint8).numpy())
        _set_field(lin, name, torch.from_numpy(arena[off:off + n]).view(t.dtype).view(t.shape))
        off += n
    return total

