"""Weight matrices, packed or dense, and their products with activations.

A `Linear` holds an [N, K] weight in one of these ways:
- dense: a float32 tensor;
- re-blocked into the native kernels' own layouts (`kernels/cpu/simd.h`), from Q4_0, Q4_1, Q4_K
  (as Q4_F32, our name for Q4_K in groups of 32 with float32 scale and min) and Q8_0:
    4-bit: `data` uint8 [N, K/2] nibbles, `scale` and `min` [N, K/32]; w = scale * q + min
    8-bit: `data` int8 [N, K], `scale` [N, K/32];                      w = scale * q
  with the scales in fp16 as the file has them (Q4_0, Q4_1, Q8_0); Q4_K keeps its 6-bit scales and
  mins and the super-blocks' fp16 d and dmin instead (`kq`), from which the kernels compute the fp32
  scale and min of each group as they go (`planes()` makes them for other readers);
- re-blocked, from Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS and Q6_K (when K is a multiple of 64 and the native
  kernels are built): the same bytes per row as the file's blocks, laid out by planes (low 4 bits, high
  bits, scales; `kernels/cpu/qtypes.h`, QT_R_*) so the products read them as the 4-bit layout's;
- re-encoded, from the lattice, ternary and MXFP4 types, Q2_K and Q3_K (`REENCODE`): every value kept, in 4-bit planes
  the fast kernels multiply (IQ4_XS's or IQ4_NL's with the type's own 16 values, or the per-16 IQ planes);
- raw: every other ggml type (Q4_K, F16, BF16, and the ones above otherwise) as the
  file's own blocks, row by row, read in place from the memory-mapped GGUF (`kernels/cpu/qtypes.h`
  decodes them block by block inside the products).
A fused product whose parts are stored in different ways (a Q4_K_M file's Q4_K Q/K with a Q6_K V)
keeps its `parts`, stacked by output rows. Whatever the storage, `dequantize()` equals GGUF's
reference dequantization bit for bit.
"""
from __future__ import annotations

import contextlib
import os
import functools
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import ctypes

import numpy as np
import torch

from slipstream.kernels.cpu import load_library
from slipstream.kernels.cpu.abi import KIND_F32, KIND_Q4, KIND_Q8, KIND_QT, Q4_K6, SSMat
from slipstream.kernels.cpu.iq_grids import GRID_TYPES
from slipstream.kernels.cpu.iq_grids import install as install_grids

Q4_0, Q4_1, Q8_0, Q4_F32 = 2, 3, 8, 100       # ggml's type ids; Q4_F32 is ours
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_F32: 24}
FORMAT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_F32: "Q4_K"}
# ggml types kept as the file's blocks: id -> (name, weights per block, bytes per block)
RAW_TYPES = {1: ("F16", 1, 2), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 10: ("Q2_K", 256, 84),
             11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
             20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 30: ("BF16", 1, 2),
             # the lattice, ternary and MXFP4 types (kernels/cpu/iqtypes.h)
             16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 22: ("IQ2_S", 256, 82), 18: ("IQ3_XXS", 256, 98),
             21: ("IQ3_S", 256, 110), 19: ("IQ1_S", 256, 50), 29: ("IQ1_M", 256, 56), 34: ("TQ1_0", 256, 54),
             35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17)}
# ggml types re-blocked at load -> our format id (100 + the ggml id; qtypes.h's QT_R_*)
REBLOCK = {6: 106, 7: 107, 13: 113, 14: 114, 20: 120, 23: 123}
# ggml types re-encoded at load -> our format id: the lattice and ternary types whose weights are each one of
# 16 values times a per-32 scale (IQ2_XXS, IQ3_XXS, IQ1_S, IQ3_S, TQ1_0, TQ2_0) into IQ4_XS's planes with
# their own values, MXFP4 into IQ4_NL's; every value kept (4.25 and 4.5 bits a weight, against 1.6-3.4 in
# the file): the IQ4 kernels multiply them, 3.5-5x faster per core than decoding the file's blocks in each
# product (docs/BENCHMARKS.md). SLIPSTREAM_IQ_IN_PLACE=1, or too little free memory, keeps the file's blocks.
# The types whose scale is per 16 weights (IQ2_XS, IQ2_S, IQ1_M, and Q3_K: 8 codes x d (sc - 32)) go into the per-16
# IQ planes (4.56 bits a weight; qtypes.h qt_rb16), which Q6_K's kernels multiply, 5-8x faster than decoding the
# file's blocks (Q3_K: 3.44 bits a weight in the file). Q2_K's planes add its per-16 minimums (5.12 bits, against 2.63).
REENCODE = {16: 116, 18: 118, 19: 119, 21: 121, 34: 134, 35: 135, 39: 139, 17: 117, 22: 122, 29: 129, 11: 111, 10: 110}
PER16_REENCODE = {17, 22, 29, 11, 10}   # the ggml types of REENCODE whose planes keep a scale per 16 weights
REBLOCKED = {v: k for k, v in {**REBLOCK, **REENCODE}.items()}   # our id -> the ggml type it came from
MIXED = -1   # `fmt` of a Linear made of `parts` stored in different ways
# From this many activation rows on (prefill), widen the weights once and use BLAS: the matvec
# kernels re-expand every weight group per 8 rows, a dense GEMM tiles far better.
DENSE_FROM_ROWS = 32
# Both paths are row-invariant (a row's result does not depend on the other rows), but they round
# differently. The engine pins short prompt chunks and the LM head to the kernel path so that a
# request's tokens do not depend on what else shares its step (batch invariance). BLAS is row-invariant
# only for one shape: oneDNN picks its kernels (and its split among threads) by the number of rows, and a
# row's sums came out differently beside other rows (bf16: 5 of 30 shapes x splits single-threaded; fp32 with
# two threads: 12 of 30). So the exact path's BLAS products multiply BLAS_ROWS rows per call, the last block
# zero-padded (`blas_mode("fp32-fixed")`): one shape per matrix, the same result for a row whatever shares its
# step, at a cost (a 512-token prompt's TTFT on the default model 1.2x; docs/BENCHMARKS.md). The fast path, whose
# int8 products may flip a near-tie with the batch anyway, keeps one call per chunk.
BLAS_ROWS = 128
_path = threading.local()


@contextlib.contextmanager
def matvec_only() -> Iterator[None]:
    """Within this block packed products use the matvec kernels whatever the number of rows."""
    old = getattr(_path, "matvec_only", False)
    _path.matvec_only = True
    try:
        yield
    finally:
        _path.matvec_only = old


@contextlib.contextmanager
def routed_rows() -> Iterator[None]:
    """Around the products of the rows routed to one MoE expert, whose number depends on the whole step's
    routing. On the exact path's eager step (`blas_mode("fp32-fixed")`) they take the row kernels whatever
    their number (`matvec_only`), as decode rows do: with BLAS from DENSE_FROM_ROWS rows on, a token's expert
    product changed kernels with the number of other tokens routed to that expert, and so its bits. Elsewhere
    nothing changes (the fast path's long prompts keep BLAS for their experts)."""
    if not rows_invariant():
        yield
        return
    with matvec_only():
        yield


def rows_invariant() -> bool:
    """Whether this is the exact path's eager step (`blas_mode("fp32-fixed")`), whose every row must come out
    the same whatever rows share the step."""
    return getattr(_path, "blas", "fp32") == "fp32-fixed"


BLAS_MODES = ("fp32", "fp32-fixed", "bf16")


def dense_from_rows() -> int:
    """The activation rows from which packed products take BLAS within this block (`blas_mode`'s
    `dense_from_rows`; DENSE_FROM_ROWS outside one)."""
    return int(getattr(_path, "dense_from", DENSE_FROM_ROWS))


@contextlib.contextmanager
def blas_mode(mode: str, dense_from_rows: int | None = None) -> Iterator[None]:
    """How the BLAS path of packed weights (long prompt chunks: the eager step) multiplies within this block:
    "fp32": one fp32 GEMM per chunk (the default); "fp32-fixed": fp32, BLAS_ROWS rows per call, so a row's
    result never depends on the rows beside it (the exact path: `CpuTeamDecoder.eager_blas`); "bf16": the
    weights widened to bf16, the activations rounded to it (the fast path's eager step on AMX machines, where
    oneDNN's bf16 tiles run it ~7x faster than fp32: benchmarks/prefill_bf16.py). `dense_from_rows`: from how many
    rows a product takes BLAS here (default DENSE_FROM_ROWS): one number for every product of the step, so that
    a chunk's path never depends on the chunks beside it (engine/execute.py splits the chunks by it)."""
    if mode not in BLAS_MODES:
        raise ValueError(f"unknown BLAS mode {mode!r} ({', '.join(BLAS_MODES)})")
    old, old_from = getattr(_path, "blas", "fp32"), getattr(_path, "dense_from", DENSE_FROM_ROWS)
    _path.blas = mode
    _path.dense_from = DENSE_FROM_ROWS if dense_from_rows is None else max(1, int(dense_from_rows))
    try:
        yield
    finally:
        _path.blas, _path.dense_from = old, old_from


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised C-contiguous array starting on a 64-byte boundary, as torch's CPU allocator
    places tensors (numpy's malloc gives 16): weights converted with numpy keep torch's alignment."""
    dt = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    buf = np.empty(size + 64, np.uint8)
    off = -buf.ctypes.data % 64
    return buf[off:off + size].view(dt).reshape(shape)


def aligned(a: np.ndarray, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A 64-byte-aligned contiguous copy of `a` (reshaped to `shape`) as a tensor."""
    out = aligned_empty(a.shape, a.dtype)
    np.copyto(out, a)
    return torch.from_numpy(out if shape is None else out.reshape(shape))


def _f16_np(b: np.ndarray) -> np.ndarray:
    """Two bytes per value (last axis) -> float16 values."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


@dataclass
class Linear:
    n: int                              # output features
    k: int                              # input features
    data: torch.Tensor                  # float32 [N, K] | uint8 [N, K/2] | int8 [N, K]
    fmt: int | None = None              # None = dense, else the ggml format it came from
    scale: torch.Tensor | None = None   # float32 or float16 [N, K/32]
    min: torch.Tensor | None = None     # [N, K/32] (4-bit formats), the scale's dtype; Q4_0 with fp16
                                        # scales: None (its offsets are -8 x the scales, see `mins`)
    bias: torch.Tensor | None = None
    parts: tuple["Linear", ...] | None = None   # fmt MIXED: the row blocks, each stored its own way
    # Q4_F32 from Q4_K: its scales as the file has them, the 6-bit scales and mins (uint8 [N, K/32]) and the
    # super-blocks' fp16 d and dmin ([N, K/256, 2]), with `scale` and `min` None: 2.5 bytes per 32 weights
    # instead of the fp32 planes' 8. The kernels widen a row's scales as they go (step.c, ss_k6_row); the
    # AVX-512 VNNI kernels read a compact tile-ordered copy of them (`_tile_k`)
    kq: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.kq is not None:   # the 6-bit form holds all of it (an artifact written before kept both)
            self.scale = self.min = None
        if self.fmt in GRID_TYPES:   # the native decoders need gguf-py's grids before the first product
            install_grids(load_library())

    @property
    def packed(self) -> bool:
        return self.fmt is not None

    @property
    def raw(self) -> bool:
        """Stored as the GGUF file's own blocks."""
        return self.fmt in RAW_TYPES

    @property
    def reblocked(self) -> bool:
        """Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS or Q6_K re-blocked at load (same bytes, laid out by planes)."""
        return self.fmt in REBLOCKED

    @property
    def blocks(self) -> bool:
        """Rows of blocks decoded by `kernels/cpu/qtypes.h` (raw or re-blocked)."""
        return self.fmt in RAW_TYPES or self.fmt in REBLOCKED

    def mins(self) -> torch.Tensor | None:
        """The 4-bit formats' per-group offsets. Q4_0 keeps no min plane (2 bytes per 32 weights that
        every product would read): d*(q-8) == d*q + (-8d) exactly, so they are -8 x its scales."""
        if self.kq is not None:
            return self.planes()[1]
        if self.min is not None or self.fmt != Q4_0 or self.scale is None:
            return self.min
        return self.scale * -8

    def planes(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The per-group scales and offsets as [N, K/32] planes (None for dense weights; the offsets
        None for Q8_0). A Q4_K matrix's are made from its 6-bit form each time (fp32, the values
        GGUF's dequantization gives: d x scale and -(dmin x min) are exact in fp32), not kept."""
        if self.kq is None:
            return self.scale, self.mins()
        sc, mn, dd = self.kq
        groups = sc.shape[1]
        d, dmin = (dd[..., i].to(torch.float32).unsqueeze(-1) for i in (0, 1))
        scale = (d * sc.view(self.n, groups // 8, 8).to(torch.float32)).reshape(self.n, groups)
        return scale, (-(dmin * mn.view(self.n, groups // 8, 8).to(torch.float32))).reshape(self.n, groups)

    @property
    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.min, self.bias, *(self.kq or ()))
                  if t is not None)
        return own + sum(p.nbytes for p in self.parts or ())

    @property
    def format_name(self) -> str:
        if self.fmt is None:
            return "F32"
        if self.parts:
            return "+".join(p.format_name for p in self.parts)
        if self.reblocked:
            return RAW_TYPES[REBLOCKED[self.fmt]][0]
        return RAW_TYPES[self.fmt][0] if self.raw else FORMAT_NAMES[self.fmt]

    @staticmethod
    def from_raw(fmt: int, blocks: np.ndarray | torch.Tensor, n: int, k: int, reblock: bool = True) -> "Linear":
        """ggml blocks of a type in RAW_TYPES, used in place (no copy of a memory-mapped file), or
        for the types in REBLOCK re-blocked into a copy of the same size (`reblock`, when the native
        kernels are built and K is a multiple of 64)."""
        name, qk, bb = RAW_TYPES[fmt]
        if k % qk:
            raise ValueError(f"{name} weights need K divisible by {qk}, got {k}")
        # numpy until the end (as in `from_blocks`): loading touches no torch kernel
        raw = blocks.view(np.uint8).reshape(n, -1) if isinstance(blocks, np.ndarray) else \
            blocks.view(torch.uint8).reshape(n, -1)
        if raw.shape[1] != k // qk * bb:
            raise ValueError(f"a {name} row of {k} weights needs {k // qk * bb} bytes, got {raw.shape[1]}")
        if reblock and fmt in REENCODE:
            coded = _reencoded(fmt, raw, n, k)
            if coded is not None:
                return coded
        lib = load_library() if reblock and fmt in REBLOCK and k % 64 == 0 else None
        if lib is not None:
            src = np.ascontiguousarray(raw) if isinstance(raw, np.ndarray) else raw.contiguous()
            out = aligned_empty(src.shape, np.uint8)
            fn = lib.ss_reblock
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
            fn.restype = None
            fn(fmt, src.ctypes.data if isinstance(src, np.ndarray) else src.data_ptr(), n, k, out.ctypes.data)
            return Linear(n, k, torch.from_numpy(out), REBLOCK[fmt])
        if isinstance(raw, np.ndarray):
            with warnings.catch_warnings():   # a read-only map: the kernels never write weights
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(raw)
        return Linear(n, k, raw, fmt)

    def ggml_blocks(self) -> "Linear":
        """A re-blocked weight as the ggml blocks it came from (the inverse of `from_raw`'s
        re-blocking; other weights as they are). Not for the re-encoded types (REENCODE)."""
        if not self.reblocked:
            return self
        if self.fmt in REENCODED:
            raise ValueError(f"a {self.format_name} weight re-encoded at load keeps no ggml blocks")
        src = REBLOCKED[self.fmt]
        n, g = self.n, self.k // 32
        d = self.data.contiguous().numpy().reshape(n, -1)
        nib = d[:, :16 * g].reshape(n, g // 2, 1, 32)
        c4 = np.concatenate([nib & 15, nib >> 4], axis=2).reshape(n, g, 32)   # low 4 bits of each code
        parts = []
        if src == 14:   # Q6_K: ql[128] qh[64] scales[16] d per 256 weights
            s = g // 8
            hi = d[:, 16 * g:24 * g].reshape(n, g // 4, 1, 32)
            top = ((hi >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3).reshape(n, g, 32)
            c = (c4 | (top << 4)).reshape(n, s, 2, 4, 32)           # element 128 h + 32 j + l
            lo, up = c & 15, c >> 4
            ql = (lo[:, :, :, 0:2] | (lo[:, :, :, 2:4] << 4)).reshape(n, s, 128)
            qh = (up[:, :, :, 0] | (up[:, :, :, 1] << 2) | (up[:, :, :, 2] << 4) | (up[:, :, :, 3] << 6)).reshape(n, s, 64)
            sc = d[:, 24 * g:26 * g].reshape(n, s, 2, 8).transpose(0, 1, 3, 2).reshape(n, s, 16)
            blocks = [ql, qh, sc, d[:, 26 * g:].reshape(n, s, 2)]
            raw = np.ascontiguousarray(np.concatenate(blocks, axis=2).astype(np.uint8).reshape(n, -1))
            return Linear(n, self.k, torch.from_numpy(raw), src, bias=self.bias)
        if src == 23:   # IQ4_XS: per 256 weights its 8-byte header, then the 8 groups' codes
            qs = (c4[..., :16] | (c4[..., 16:] << 4)).astype(np.uint8).reshape(n, g // 8, 128)
            raw = np.concatenate([d[:, 16 * g:17 * g].reshape(n, g // 8, 8), qs], axis=2)
            return Linear(n, self.k, torch.from_numpy(np.ascontiguousarray(raw.reshape(n, -1))), src, bias=self.bias)
        if src == 13:   # Q5_K: d dmin scales[12] qh[32] qs[128] per 256 weights
            s, k8 = g // 8, np.arange(8, dtype=np.uint16)
            quads = d[:, 16 * g:20 * g].reshape(n, g // 4, 1, 16)
            shifts = np.arange(4, dtype=np.uint8).reshape(1, 1, 4, 1)
            hi = np.concatenate([(quads >> shifts) & 1, (quads >> (shifts + 4)) & 1], axis=3).reshape(n, s, 8, 32)
            qh = (hi << k8.astype(np.uint8).reshape(1, 1, 8, 1)).sum(axis=2).astype(np.uint8)
            hdr = d[:, 20 * g:22 * g].reshape(n, s, 16)
            lo = hdr[..., :8]
            top = lambda i: (((hdr[..., i].astype(np.uint16) | (hdr[..., i + 1].astype(np.uint16) << 8))[..., None]  # noqa: E731
                              >> (2 * k8)) & 3).astype(np.uint8)
            sc, mn = (lo & 15) | (top(8) << 4), (lo >> 4) | (top(10) << 4)
            scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                                     (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=2)
            blocks = [hdr[..., 12:16], scales, qh, d[:, :16 * g].reshape(n, s, 128)]
            raw = np.ascontiguousarray(np.concatenate(blocks, axis=2).astype(np.uint8).reshape(n, -1))
            return Linear(n, self.k, torch.from_numpy(raw), src, bias=self.bias)
        if src == 20:
            parts.append(d[:, 16 * g:18 * g].reshape(n, g, 2))
        else:
            g4 = g // 4 * 4
            quads = d[:, 16 * g:16 * g + 4 * g4].reshape(n, g4 // 4, 1, 16)
            shifts = np.arange(4, dtype=np.uint8).reshape(1, 1, 4, 1)
            hi = np.concatenate([(quads >> shifts) & 1, (quads >> (shifts + 4)) & 1], axis=3).reshape(n, g4, 32)
            tail = np.unpackbits(d[:, 16 * g + 4 * g4:20 * g].reshape(n, g - g4, 4), axis=2, bitorder="little")
            qh = np.packbits(np.concatenate([hi, tail], axis=1), axis=2, bitorder="little")   # [n, g, 4]
            parts.append(d[:, 20 * g:22 * g].reshape(n, g, 2))
            if src == 7:
                parts.append(d[:, 22 * g:24 * g].reshape(n, g, 2))
            parts.append(qh)
        parts.append((c4[..., :16] | (c4[..., 16:] << 4)).astype(np.uint8))
        raw = np.ascontiguousarray(np.concatenate(parts, axis=2).reshape(n, -1))
        return Linear(n, self.k, torch.from_numpy(raw), src, bias=self.bias)

    def block_cols(self, c0: int, c1: int) -> "Linear | None":
        """Columns [c0, c1) of a re-blocked weight, still packed (None when they do not start and end
        on the blocks it came from)."""
        if not self.reblocked:
            return None
        if self.fmt in REENCODED:   # the planes themselves: codes then (XS) 8-byte headers or (NL) fp16 scales
            step, head = (64, 2) if self.fmt == REENCODE[39] else (256, 1)
            if c0 % step or c1 % step:
                return None
            G, g0, g1 = self.k // 32, c0 // 32, c1 // 32
            d = self.data
            if REBLOCKED[self.fmt] in PER16_REENCODE:   # codes, 16 int8 scales per 8 groups, then an fp16 d per 8
                cut = [d[:, 16 * g0:16 * g1], d[:, 16 * G + 2 * g0:16 * G + 2 * g1], d[:, 18 * G + g0 // 4:18 * G + g1 // 4]]
                if REBLOCKED[self.fmt] == 10:   # Q2_K's minimums and dmin, as the scales and d
                    m = 18 * G + G // 4
                    cut += [d[:, m + 2 * g0:m + 2 * g1], d[:, m + 2 * G + g0 // 4:m + 2 * G + g1 // 4]]
            else:
                cut = [d[:, 16 * g0:16 * g1], d[:, 16 * G + head * g0:16 * G + head * g1]]
            return Linear(self.n, c1 - c0, torch.cat(cut, dim=1).contiguous(), self.fmt)
        g = self.ggml_blocks()
        _, qk, bb = RAW_TYPES[g.fmt]
        if c0 % qk or c1 % qk:
            return None
        return Linear.from_raw(g.fmt, g.data[:, c0 // qk * bb:c1 // qk * bb].contiguous(), self.n, c1 - c0)

    @staticmethod
    def dense(w: torch.Tensor, bias: torch.Tensor | None = None) -> "Linear":
        w = w.to(torch.float32).contiguous()
        return Linear(w.shape[0], w.shape[1], w, None,
                      bias=None if bias is None else bias.to(torch.float32).contiguous())

    @staticmethod
    def from_blocks(fmt: int, blocks: np.ndarray | torch.Tensor, n: int, k: int) -> "Linear":
        """From ggml block bytes, row by row ([N, K/32 * block bytes]). The bytes are split with numpy
        (exact copies and one exact multiply): loading touches no torch kernel, whose code pages
        would otherwise add ~7 MB to the resident memory after load."""
        if k % 32:
            raise ValueError(f"packed weights need K divisible by 32, got {k}")
        raw = np.asarray(blocks, dtype=np.uint8).reshape(n, -1)   # the file's bytes, read in place
        if raw.shape[1] != k // 32 * BLOCK_BYTES[fmt]:
            raise ValueError(f"a {FORMAT_NAMES[fmt]} row of {k} weights needs "
                             f"{k // 32 * BLOCK_BYTES[fmt]} bytes, got {raw.shape[1]}")
        b = raw.reshape(n, k // 32, BLOCK_BYTES[fmt])
        t = aligned
        # Q4_0, Q4_1 and Q8_0 keep their fp16 scales (the kernels widen a row's scales as they go):
        # 5 bits per weight for Q4_1 instead of 6 with fp32 scales and mins
        if fmt == Q8_0:
            return Linear(n, k, t(b[..., 2:].view(np.int8), (n, k)), fmt, t(_f16_np(b[..., 0:2])))
        if fmt == Q4_F32:
            d = np.ascontiguousarray(b[..., 0:4]).view(np.float32)[..., 0]
            m = np.ascontiguousarray(b[..., 4:8]).view(np.float32)[..., 0]
        else:
            d = _f16_np(b[..., 0:2])
            # d*(q-8) == d*q + (-8d), exactly (a power-of-two multiple); fp32 if -8d overflows fp16
            if fmt == Q4_1:
                m = _f16_np(b[..., 2:4])
            elif np.abs(d).max(initial=0) < 4096:   # Q4_0: no min plane (see `mins`)
                m = None
            else:   # -8d would overflow fp16: fp32 scales and their mins
                d = d.astype(np.float32)
                m = d * d.dtype.type(-8)
        return Linear(n, k, t(b[..., BLOCK_BYTES[fmt] - 16:], (n, k // 2)), fmt, t(d),
                      None if m is None else t(m))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "Linear":
        """On `device`; dense weights also cast to `dtype` (packed codes and their scales keep theirs).
        The GPU kernels read the 4- and 8-bit layouts only: other formats go there dense."""
        if (self.blocks or self.parts) and torch.device(device).type != "cpu":
            return Linear.dense(self.dequantize(), self.bias).to(device, dtype)
        if self.parts:
            return self
        gpu = torch.device(device).type != "cpu"
        # the GPU kernels read fp32 scales
        mv = lambda t: None if t is None else t.to(device, torch.float32 if gpu and t.dtype == torch.float16 else t.dtype)  # noqa: E731
        data = self.data.to(device=device, dtype=dtype) if self.fmt is None and dtype else self.data.to(device)
        if gpu:   # the GPU kernels read planes, and a min plane (Q4_0's made there from its scales)
            sc, mn = self.planes()
            return Linear(self.n, self.k, data, self.fmt, mv(sc), mv(mn), mv(self.bias))
        return Linear(self.n, self.k, data, self.fmt, mv(self.scale), mv(self.min), mv(self.bias),
                      kq=None if self.kq is None else tuple(t.to(device) for t in self.kq))  # type: ignore[arg-type]

    def select_rows(self, rows: torch.Tensor) -> "Linear":
        if self.parts:
            return Linear.dense(self.dequantize(rows), None if self.bias is None else self.bias[rows])
        pick = lambda t: None if t is None else t[rows].contiguous()  # noqa: E731
        return Linear(int(rows.numel()), self.k, pick(self.data), self.fmt, pick(self.scale),
                      pick(self.min), pick(self.bias), kq=None if self.kq is None else tuple(map(pick, self.kq)))

    # -- maths ------------------------------------------------------------------------------------
    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, K] (or the given rows), equal to GGUF's dequantization bit for bit."""
        if self.fmt is None:
            return self.data if rows is None else self.data[rows]
        if self.parts:
            full = torch.cat([p.dequantize() for p in self.parts])
            return full if rows is None else full[rows]
        w = self if rows is None else self.select_rows(rows)
        if self.blocks:
            return _raw_dequantize(w)
        groups = w.k // 32
        scale, mins = w.scale, w.min
        if w.kq is not None:
            scale, mins = w.planes()
        if self.fmt == Q8_0:
            q = w.data.view(w.n, groups, 32).to(torch.float32)
            return (scale.unsqueeze(-1) * q).view(w.n, w.k)
        p = w.data.view(w.n, groups, 16)
        q = torch.cat([p & 15, p >> 4], dim=-1).to(torch.float32)
        if self.fmt == Q4_0:  # same values as scale*q + min, and ggml's sign of zero too
            return (scale.unsqueeze(-1) * (q - 8)).view(w.n, w.k)
        return (scale.unsqueeze(-1) * q + mins.unsqueeze(-1)).view(w.n, w.k)

    def _widened(self) -> torch.Tensor:
        """Packed weights on a GPU: dequantized once to bf16 for the eager path (prefill), instead
        of at every call; the decode kernels read the packed codes."""
        w = getattr(self, "_dense", None)
        if w is None:
            w = self.dequantize().to(torch.bfloat16)
            self._dense = w
        return w

    def widen(self, lib) -> torch.Tensor:
        """The dense float32 weight, by the native kernel (same values as `dequantize`, faster)."""
        if self.blocks or self.parts:
            return self.dequantize()
        w = torch.empty(self.n, self.k, dtype=torch.float32)
        scale, mins = self.planes()   # Q4_K's made from its 6-bit scales
        sc, mn = scale.float(), None if mins is None else mins.float()   # fp16 scales widened
        if self.fmt == Q8_0:
            lib.q8_dequant(self.data.data_ptr(), sc.data_ptr(), self.n, self.k, w.data_ptr())
        else:
            lib.q4_dequant(self.data.data_ptr(), sc.data_ptr(), mn.data_ptr(), self.n, self.k, w.data_ptr())
        return w

    def widen_bf16(self, lib) -> torch.Tensor:
        """The dense weight rounded to bf16 (`widen(lib).to(torch.bfloat16)`, the same bits but a NaN's): GGUF
        block types straight to bf16 by the native decoder, without an fp32 copy of the matrix."""
        if self.parts:
            return torch.cat([p.widen_bf16(lib) for p in self.parts])
        if self.blocks and self.fmt == 30 and self.data.device.type == "cpu":   # BF16: the file's own bits
            return self.data.contiguous().view(torch.bfloat16).reshape(self.n, self.k)
        if self.blocks and self.data.device.type == "cpu":
            out = torch.empty(self.n, self.k, dtype=torch.bfloat16)
            data = self.data.contiguous()   # held until the call returns (a copy when the rows are a view)
            lib.ss_qt_dequant_bf16(self.fmt, data.data_ptr(), 0, self.n, self.k, out.data_ptr())
            return out
        return self.widen(lib).to(torch.bfloat16)

    def native(self, lib, x_ptr: int, rows: int, out_ptr: int, accumulate: bool, scratch_ptr: int) -> None:
        """The kernel call on raw pointers: x float32 [rows, K] -> out float32 [rows, N]."""
        if self.blocks or self.parts or self.kq is not None or self.scale.dtype == torch.float16:   # the step's row kernels (exact)
            if not accumulate:
                lib.ss_matmul(ctypes.byref(self.ss_mat(with_bias=False)), rows, x_ptr, out_ptr, 1)
                return
            y = torch.empty(rows, self.n, dtype=torch.float32)
            lib.ss_matmul(ctypes.byref(self.ss_mat(with_bias=False)), rows, x_ptr, y.data_ptr(), 1)
            lib.ss_add_rows(out_ptr, y.data_ptr(), rows * self.n)
            return
        if self.fmt == Q8_0:
            lib.q8_matvec(x_ptr, rows, self.k, self.data.data_ptr(), self.scale.data_ptr(), self.n,
                          out_ptr, int(accumulate))
        else:
            lib.q4_matvec(x_ptr, rows, self.k, self.data.data_ptr(), self.scale.data_ptr(),
                          self.min.data_ptr(), self.n, out_ptr, int(accumulate), scratch_ptr)

    def ss_mat(self, with_bias: bool = True) -> SSMat:
        """The native step's view of this matrix (raw pointers: keep this Linear alive while it is used)."""
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        if self.parts:
            # a chain of the parts' matrices; the bias is sliced onto them; the structures are kept
            # on this Linear so that the pointers between them stay valid
            bias = self.bias if with_bias else None
            mats, r = [], 0
            for p in self.parts:
                m = p.ss_mat(with_bias=False)
                if bias is not None:
                    m.bias = bias[r:r + p.n].data_ptr()
                mats.append(m)
                r += p.n
            for a, b in zip(mats, mats[1:]):
                a.next = ctypes.pointer(b)
            self._chain = mats
            return mats[0]
        if self.blocks:
            return SSMat(self.data.data_ptr(), None, None, ptr(self.bias) if with_bias else None, KIND_QT,
                         self.n, self.k, self.fmt)
        if not self.packed:
            if self.data.dtype != torch.float32 or not self.data.is_contiguous():
                raise ValueError("dense weights must be contiguous float32 for the native kernels")
            return SSMat(self.data.data_ptr(), None, None, ptr(self.bias) if with_bias else None, KIND_F32,
                         self.n, self.k, 0)
        kind = KIND_Q8 if self.fmt == Q8_0 else KIND_Q4
        bias_ptr = ptr(self.bias) if with_bias else None
        if self.kq is not None:   # Q4_K: its 6-bit scales and mins, and the super-blocks' d and dmin
            m = SSMat(self.data.data_ptr(), self.kq[0].data_ptr(), self.kq[1].data_ptr(), bias_ptr, KIND_Q4,
                      self.n, self.k, Q4_K6)
            m.kdm = self.kq[2].data_ptr()
        else:
            half = 1 if self.scale.dtype == torch.float16 else 0   # qtype F16: fp16 scales and mins
            m = SSMat(self.data.data_ptr(), self.scale.data_ptr(), ptr(self.min), bias_ptr, kind, self.n, self.k,
                      half)
        planes_mode = tile_planes()
        if planes_mode:
            # the AVX-512 VNNI / AMX kernels (kernels/cpu/amx.h) take a group's scales for 16 rows at a time, the
            # AVX2 ones for 8 (half a block): a copy of the planes in that order (1/4 of the codes' bytes for
            # Q4_1) saves a gather per group; a Q4_K matrix's copy is its compact form (`_tile_k`), which the
            # kernels widen to the planes' values
            if getattr(self, "_planes_by_tile", None) is None:
                if self.kq is not None:
                    self._planes_by_tile = _tile_k(*self.kq)
                else:
                    self._planes_by_tile = (_tile_ordered(self.scale),
                                            None if self.min is None else _tile_ordered(self.min))
            planes = self._planes_by_tile
            m.scale_t, m.min_t = planes[0].data_ptr(), ptr(planes[1])
            m.tile_k = int(len(planes) == 3)
        return m

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 accumulate: bool = False) -> torch.Tensor:
        """y = x @ W.T (+ bias) for x [rows, K]; with accumulate=True adds into `out` (residual add)."""
        lib = load_library() if self.fmt is not None and self.data.device.type == "cpu" else None
        if (lib is None and self.fmt is None and getattr(_path, "matvec_only", False) and x.dim() == 2
                and getattr(_path, "blas", "fp32") == "fp32-fixed" and self.data.dtype == torch.float32
                and self.data.device.type == "cpu" and self.data.is_contiguous() and x.shape[-1] == self.k):
            # dense fp32 rows pinned to the kernel path on the exact eager step (the LM head, an expert's rows):
            # the step's exact row kernels, whose result for a row does not depend on how many share the call
            lib = load_library()
            if lib is not None:
                xs = x.to(torch.float32).contiguous()
                y = torch.empty(xs.shape[0], self.n, dtype=torch.float32)
                lib.ss_matmul(ctypes.byref(self.ss_mat(with_bias=False)), xs.shape[0], xs.data_ptr(), y.data_ptr(), 1)
                if self.bias is not None:
                    y.add_(self.bias)
                y = y.to(x.dtype)
                if out is None:
                    return y
                return out.add_(y) if accumulate else out.copy_(y)
        if lib is None:   # dense weights, or no native kernels (a GPU): torch in the weight's dtype
            w = self._widened() if self.fmt is not None and self.data.device.type != "cpu" else self.dequantize()
            bias = None if self.bias is None else self.bias.to(w.dtype)
            if (getattr(_path, "blas", "fp32") == "fp32-fixed" and w.device.type == "cpu" and w.dtype == torch.float32
                    and x.dim() == 2 and x.shape[0] >= dense_from_rows()):   # dense fp32 on the exact path: row blocks
                y = _blas_rows(x.to(torch.float32).contiguous(), w, bias, "fp32-fixed").to(x.dtype)
            else:
                y = torch.nn.functional.linear(x.to(w.dtype), w, bias).to(x.dtype)
            if out is None:
                return y
            return out.add_(y) if accumulate else out.copy_(y)
        if x.shape[-1] != self.k:
            raise ValueError(f"expected {self.k} input features, got {x.shape[-1]}")
        if out is not None and (out.dtype != torch.float32 or not out.is_contiguous()):
            y = self(x)
            return out.add_(y) if accumulate else out.copy_(y)
        rows = x.shape[0]
        x = x.to(torch.float32).contiguous()
        if rows >= dense_from_rows() and not getattr(_path, "matvec_only", False):
            mode = getattr(_path, "blas", "fp32")
            y = _blas_rows(x, self.widen_bf16(lib) if mode == "bf16" else self.widen(lib), self.bias, mode)
            if out is None:
                return y
            return out.add_(y) if accumulate else out.copy_(y)
        if out is None:
            out = torch.empty(rows, self.n, dtype=torch.float32)
            accumulate = False
        scratch = torch.empty(rows * max(1, self.k // 32), dtype=torch.float32)
        self.native(lib, x.data_ptr(), rows, out.data_ptr(), accumulate, scratch.data_ptr())
        if self.bias is not None:
            out.add_(self.bias)
        return out


def _blas_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, mode: str) -> torch.Tensor:
    """x [rows, K] @ w.T (+ bias) by BLAS, as `blas_mode` says: one fp32 call; fp32 BLAS_ROWS rows per call
    (the last block zero-padded: see BLAS_ROWS); or one call on weights and activations rounded to bf16 (as is
    each product's result: torch has no fp32 output for a bf16 product on the CPU), the bias added in fp32."""
    if mode == "fp32":
        return torch.nn.functional.linear(x, w, bias)
    if mode == "bf16":
        y = torch.nn.functional.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).float()
        return y if bias is None else y.add_(bias)
    rows = x.shape[0]
    out = torch.empty(rows, w.shape[0], dtype=torch.float32)
    for r0 in range(0, rows, BLAS_ROWS):
        block = x[r0:r0 + BLAS_ROWS]
        n = block.shape[0]
        if n < BLAS_ROWS:
            block = torch.cat([block, block.new_zeros(BLAS_ROWS - n, block.shape[1])])
        out[r0:r0 + n] = torch.nn.functional.linear(block, w)[:n]
    if bias is not None:
        out.add_(bias)
    return out


def weight_linears(weights: dict[str, Any]) -> list[Linear]:
    """Every distinct stored matrix of a loaded model's weights (layers through their `linears()`, and
    the parts of a mixed Linear), each once: tied embeddings share one Linear."""
    seen: dict[int, Linear] = {}
    for w in weights.values():
        for lin in w.linears() if hasattr(w, "linears") else [w] if isinstance(w, Linear) else []:
            for part in lin.parts or (lin,):
                seen.setdefault(id(part), part)
    return list(seen.values())


def _layout(p: Linear) -> object:
    """Parts with the same layout concatenate into one matrix."""
    if p.blocks:
        return ("raw", p.fmt)
    return "q8" if p.fmt == Q8_0 else "q4" if p.packed else "f32"


def concat_rows(parts: list[Linear]) -> Linear:
    """Stack weights over output rows (fused QKV, gate+up): one kernel call instead of several.
    Parts stored in different ways stay as they are, as the `parts` of a MIXED Linear."""
    if len({p.k for p in parts}) != 1:
        raise ValueError("stacked weights need the same input size")
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.n) for p in parts])
    if len({_layout(p) for p in parts}) != 1 or any(p.parts for p in parts):
        flat = [Linear(q.n, q.k, q.data, q.fmt, q.scale, q.min, kq=q.kq) for p in parts for q in (p.parts or (p,))]
        runs: list[list[Linear]] = []
        for q in flat:   # neighbours stored the same way become one part
            if runs and _layout(runs[-1][0]) == _layout(q):
                runs[-1].append(q)
            else:
                runs.append([q])
        bare = tuple(concat_rows(r) if len(r) > 1 else r[0] for r in runs)
        return Linear(sum(p.n for p in parts), parts[0].k, torch.empty(0, dtype=torch.uint8), MIXED,
                      bias=bias, parts=bare)
    cat = lambda ts: None if ts[0] is None else _cat_rows(ts)  # noqa: E731
    fmts = {p.fmt for p in parts}
    fmt = parts[0].fmt if len(fmts) == 1 else Q4_F32   # mixed 4-bit sources share one layout
    data = cat([p.data for p in parts])
    if all(p.kq is not None for p in parts):   # Q4_K throughout: their 6-bit scales stacked
        kq = tuple(_cat_rows([p.kq[i] for p in parts]) for i in range(3))  # type: ignore[index]
        return Linear(sum(p.n for p in parts), parts[0].k, data, fmt, bias=bias, kq=kq)  # type: ignore[arg-type]
    planes = [p.planes() for p in parts]   # Q4_K beside Q4_0/Q4_1 parts: fp32 planes made for it
    scales, mins = [sc for sc, _ in planes], [mn for _, mn in planes]
    if all(p.kq is None and p.min is None for p in parts):
        mins = [None]   # Q4_0 throughout (its offsets are its scales'), or Q8_0
    return Linear(sum(p.n for p in parts), parts[0].k, data, fmt, cat(scales), cat(mins), bias)


def _cat_rows(ts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(ts) of CPU tensors, by numpy where their dtype allows (loading then touches no
    torch kernel: see `Linear.from_blocks`)."""
    if all(t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES for t in ts):
        parts = [t.numpy() for t in ts]
        out = aligned_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                            np.result_type(*parts))
        return torch.from_numpy(np.concatenate(parts, out=out))
    return torch.cat(ts).contiguous()


_NUMPY_DTYPES = {torch.uint8, torch.int8, torch.float16, torch.float32}
REENCODED = set(REENCODE.values())
_iq = threading.local()


def iq_in_place_asked() -> bool:
    """SLIPSTREAM_IQ_IN_PLACE=1: the user keeps the REENCODE types as the file's blocks."""
    return os.environ.get("SLIPSTREAM_IQ_IN_PLACE", "") not in ("", "0")


@contextlib.contextmanager
def iq_in_place(on: bool) -> Iterator[None]:
    """Within this block (`on`), REENCODE types stay the file's blocks: the GGUF loader's choice for a file whose
    re-encoded copies would not fit in memory (gguf.py `_reencoding_fits`)."""
    old = getattr(_iq, "in_place", False)
    _iq.in_place = on or old
    try:
        yield
    finally:
        _iq.in_place = old


def reencoded_row_bytes(fmt: int, k: int) -> int:
    """Bytes of one row of K weights of a REENCODE type (the ggml id) once re-encoded: IQ4_NL's planes for MXFP4
    (18 per 32), the per-16 IQ planes (146 per 256; Q2_K's with minimums 164), else IQ4_XS's (136 per 256)."""
    return k // 32 * 18 if fmt == 39 else k // 256 * (164 if fmt == 10 else 146 if fmt in PER16_REENCODE else 136)


def _reencoded(fmt: int, raw: np.ndarray | torch.Tensor, n: int, k: int) -> "Linear | None":
    """A REENCODE type's blocks as our 4-bit planes (`ss_reencode`), or None to keep the file's blocks: no
    native library, K not whole blocks of the layout, SLIPSTREAM_IQ_IN_PLACE=1, the copy would not fit in the
    memory available, or a block whose values the layout cannot hold exactly."""
    lib = load_library()
    mxfp4 = fmt == 39
    if lib is None or k % (64 if mxfp4 else 256) or iq_in_place_asked() or getattr(_iq, "in_place", False):
        return None
    size = n * reencoded_row_bytes(fmt, k)
    free = available_memory()
    if free is not None and size > free // 2:   # half of what is free: the rest of the model, the KV cache
        return None
    if fmt in GRID_TYPES:
        install_grids(lib)
    src = np.ascontiguousarray(raw) if isinstance(raw, np.ndarray) else raw.contiguous()
    out = aligned_empty((n, size // n), np.uint8)
    fn = lib.ss_reencode
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    if not fn(fmt, src.ctypes.data if isinstance(src, np.ndarray) else src.data_ptr(), n, k, out.ctypes.data):
        return None
    return Linear(n, k, torch.from_numpy(out), REENCODE[fmt])


def available_memory() -> int | None:
    """Bytes of memory the kernel says can be had without swapping (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _raw_dequantize(w: Linear) -> torch.Tensor:
    """float32 [N, K] of a raw-block Linear: the native decoder, or gguf-py's without a compiler."""
    lib = load_library()
    if w.fmt in (1, 30):   # F16, BF16: widening is exact in torch
        return w.data.contiguous().view(torch.float16 if w.fmt == 1 else torch.bfloat16).to(torch.float32).reshape(w.n, w.k)
    if lib is None and w.fmt in REENCODED:
        raise ValueError(f"{w.format_name} weights re-encoded at load need the native kernels to be read (an artifact "
                         "compiled where they exist, read without a C compiler or with SLIPSTREAM_NO_NATIVE): "
                         "load the GGUF file instead")
    if lib is None and w.reblocked:   # an artifact re-blocked elsewhere, read without a compiler
        w = w.ggml_blocks()
    data = w.data.contiguous()
    if lib is None:
        import gguf
        arr = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(w.fmt))
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(w.n, w.k)
    out = torch.empty(w.n, w.k, dtype=torch.float32)
    lib.ss_qt_dequant(w.fmt, data.data_ptr(), 0, w.n, w.k, out.data_ptr())
    return out


@functools.lru_cache(maxsize=None)
def tile_planes() -> int:
    """Whether the native kernels read q4/q8 scales tile-ordered (asked once): 1 on AVX-512 VNNI and AMX builds
    (the twin and tiles), 2 on AVX2 builds (the products 8 weight rows at a time), 0 none."""
    from slipstream.kernels.cpu import load_library
    lib = load_library()
    return int(lib.ss_tile_planes()) if lib is not None else 0


def _tile_k(scales: torch.Tensor, mins: torch.Tensor, dd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A Q4_K matrix's compact tile copy (kernels/cpu/amx.h, tile_scales): for each block of 16 rows, the
    6-bit scales [G][16] (a group's 16 rows side by side) followed by the super-blocks' fp16 d [G/8][16];
    the mins and dmin likewise. Rows past N are zero. The third item marks the form."""
    def plane(six: torch.Tensor, sup: torch.Tensor) -> torch.Tensor:
        lo, hi = _tile_ordered(six), _tile_ordered(sup.contiguous())   # [NB][G][16] bytes, [NB][G/8][16] fp16
        nb = lo.shape[0]
        return aligned(np.concatenate([lo.reshape(nb, -1).numpy(), hi.reshape(nb, -1).numpy().view(np.uint8)], axis=1))

    return plane(scales, dd[..., 0]), plane(mins, dd[..., 1]), "q4_k"


def _tile_ordered(plane: torch.Tensor) -> torch.Tensor:
    """A [N][G] scale (or min) plane as [ceil(N/16)][G][16], rows past N zero: each group's 16 rows of a
    block side by side, as the AMX kernels read them."""
    n, g = plane.shape
    if n % 16:
        plane = torch.cat([plane, plane.new_zeros(-n % 16, g)])
    return plane.reshape(-1, 16, g).transpose(1, 2).contiguous()

