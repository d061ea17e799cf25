"""Weight matrices, packed or dense, and their products with activations.

A `Linear` holds an [N, K] weight either as a dense float32 tensor or packed, from one of ggml's
block formats (groups of 32 weights sharing a scale): Q4_0, Q4_1, Q8_0, or Q4_F32, our name for
Q4_K re-blocked into groups of 32 with float32 scale and min. Packed weights are stored in the
native kernels' compute layout (`kernels/cpu/quant_matvec.c`):
  4-bit: `data` uint8 [N, K/2] nibbles, `scale` and `min` float32 [N, K/32]; w = scale * q + min
  8-bit: `data` int8 [N, K], `scale` float32 [N, K/32];                      w = scale * q
Every format maps onto these without changing a weight: `dequantize()` equals GGUF's reference
dequantization bit for bit, and the kernels multiply the packed codes with fp32 activations.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from slipstream.kernels.cpu import load_library
from slipstream.kernels.cpu.abi import KIND_F32, KIND_Q4, KIND_Q8, SSMat

Q4_0, Q4_1, Q8_0, Q4_F32 = 2, 3, 8, 100       # ggml's type ids; Q4_F32 is ours
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_F32: 24}
FORMAT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_F32: "Q4_K"}
# From this many activation rows on (prefill), widen the weights once and use BLAS: the matvec
# kernels re-expand every weight group per 8 rows, a dense GEMM tiles far better.
DENSE_FROM_ROWS = 32
# Both paths are row-invariant (a row's result does not depend on the other rows), but they round
# differently. The engine pins short prompt chunks and the LM head to the kernel path so that a
# request's tokens do not depend on what else shares its step (batch invariance).
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


def _f16_to_f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32).squeeze(-1)


@dataclass
class Linear:
    n: int                              # output features
    k: int                              # input features
    data: torch.Tensor                  # float32 [N, K] | uint8 [N, K/2] | int8 [N, K]
    fmt: int | None = None              # None = dense, else the ggml format it came from
    scale: torch.Tensor | None = None   # float32 [N, K/32]
    min: torch.Tensor | None = None     # float32 [N, K/32] (4-bit formats)
    bias: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.fmt is not None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.min, self.bias)
                   if t is not None)

    @staticmethod
    def dense(w: torch.Tensor, bias: torch.Tensor | None = None) -> "Linear":
        w = w.to(torch.float32).contiguous()
        return Linear(w.shape[0], w.shape[1], w, None,
                      bias=None if bias is None else bias.to(torch.float32).contiguous())

    @staticmethod
    def from_blocks(fmt: int, blocks: np.ndarray | torch.Tensor, n: int, k: int) -> "Linear":
        """From ggml block bytes, row by row ([N, K/32 * block bytes])."""
        if k % 32:
            raise ValueError(f"packed weights need K divisible by 32, got {k}")
        raw = torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True)).reshape(n, -1)
        if raw.shape[1] != k // 32 * BLOCK_BYTES[fmt]:
            raise ValueError(f"a {FORMAT_NAMES[fmt]} row of {k} weights needs "
                             f"{k // 32 * BLOCK_BYTES[fmt]} bytes, got {raw.shape[1]}")
        b = raw.view(n, k // 32, BLOCK_BYTES[fmt])
        if fmt == Q8_0:
            return Linear(n, k, b[..., 2:].contiguous().view(torch.int8).reshape(n, k), fmt,
                          _f16_to_f32(b[..., 0:2]))
        if fmt == Q4_F32:
            d = b[..., 0:4].contiguous().view(torch.float32).squeeze(-1)
            m = b[..., 4:8].contiguous().view(torch.float32).squeeze(-1)
        else:
            d = _f16_to_f32(b[..., 0:2])
            m = _f16_to_f32(b[..., 2:4]) if fmt == Q4_1 else -8.0 * d   # d*(q-8) == d*q + (-8d), exactly
        qs = b[..., BLOCK_BYTES[fmt] - 16:].reshape(n, k // 2).contiguous()
        return Linear(n, k, qs, fmt, d.contiguous(), m.contiguous())

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "Linear":
        """On `device`; dense weights also cast to `dtype` (packed codes and their scales keep theirs)."""
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        data = self.data.to(device=device, dtype=dtype) if self.fmt is None and dtype else self.data.to(device)
        return Linear(self.n, self.k, data, self.fmt, mv(self.scale), mv(self.min), mv(self.bias))

    def select_rows(self, rows: torch.Tensor) -> "Linear":
        pick = lambda t: None if t is None else t[rows].contiguous()  # noqa: E731
        return Linear(int(rows.numel()), self.k, pick(self.data), self.fmt, pick(self.scale),
                      pick(self.min), pick(self.bias))

    # -- maths ------------------------------------------------------------------------------------
    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, K] (or the given rows), equal to GGUF's dequantization bit for bit."""
        if self.fmt is None:
            return self.data if rows is None else self.data[rows]
        w = self if rows is None else self.select_rows(rows)
        groups = w.k // 32
        if self.fmt == Q8_0:
            q = w.data.view(w.n, groups, 32).to(torch.float32)
            return (w.scale.unsqueeze(-1) * q).view(w.n, w.k)
        p = w.data.view(w.n, groups, 16)
        q = torch.cat([p & 15, p >> 4], dim=-1).to(torch.float32)
        if self.fmt == Q4_0:  # same values as scale*q + min, and ggml's sign of zero too
            return (w.scale.unsqueeze(-1) * (q - 8)).view(w.n, w.k)
        return (w.scale.unsqueeze(-1) * q + w.min.unsqueeze(-1)).view(w.n, w.k)

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
        w = torch.empty(self.n, self.k, dtype=torch.float32)
        if self.fmt == Q8_0:
            lib.q8_dequant(self.data.data_ptr(), self.scale.data_ptr(), self.n, self.k, w.data_ptr())
        else:
            lib.q4_dequant(self.data.data_ptr(), self.scale.data_ptr(), self.min.data_ptr(), self.n,
                           self.k, w.data_ptr())
        return w

    def native(self, lib, x_ptr: int, rows: int, out_ptr: int, accumulate: bool, scratch_ptr: int) -> None:
        """The kernel call on raw pointers: x float32 [rows, K] -> out float32 [rows, N]."""
        if self.fmt == Q8_0:
            lib.q8_matvec(x_ptr, rows, self.k, self.data.data_ptr(), self.scale.data_ptr(), self.n,
                          out_ptr, int(accumulate))
        else:
            lib.q4_matvec(x_ptr, rows, self.k, self.data.data_ptr(), self.scale.data_ptr(),
                          self.min.data_ptr(), self.n, out_ptr, int(accumulate), scratch_ptr)

    def ss_mat(self) -> SSMat:
        """The native step's view of this matrix (raw pointers: keep this Linear alive while it is used)."""
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        if not self.packed:
            if self.data.dtype != torch.float32 or not self.data.is_contiguous():
                raise ValueError("dense weights must be contiguous float32 for the native kernels")
            return SSMat(self.data.data_ptr(), None, None, ptr(self.bias), KIND_F32, self.n, self.k, 0)
        kind = KIND_Q8 if self.fmt == Q8_0 else KIND_Q4
        return SSMat(self.data.data_ptr(), self.scale.data_ptr(), ptr(self.min), ptr(self.bias), kind,
                     self.n, self.k, 0)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 accumulate: bool = False) -> torch.Tensor:
        """y = x @ W.T (+ bias) for x [rows, K]; with accumulate=True adds into `out` (residual add)."""
        lib = load_library() if self.fmt is not None and self.data.device.type == "cpu" else None
        if lib is None:   # dense weights, or no native kernels (a GPU): torch in the weight's dtype
            w = self._widened() if self.fmt is not None and self.data.device.type != "cpu" else self.dequantize()
            bias = None if self.bias is None else self.bias.to(w.dtype)
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
        if rows >= DENSE_FROM_ROWS and not getattr(_path, "matvec_only", False):
            y = torch.nn.functional.linear(x, self.widen(lib), self.bias)
            if out is None:
                return y
            return out.add_(y) if accumulate else out.copy_(y)
        if out is None:
            out = torch.empty(rows, self.n, dtype=torch.float32)
            accumulate = False
        scratch = torch.empty(rows * (self.k // 32), dtype=torch.float32)
        self.native(lib, x.data_ptr(), rows, out.data_ptr(), accumulate, scratch.data_ptr())
        if self.bias is not None:
            out.add_(self.bias)
        return out


def concat_rows(parts: list[Linear]) -> Linear:
    """Stack weights over output rows (fused QKV, gate+up): one kernel call instead of several."""
    kinds = {(p.fmt == Q8_0 if p.packed else None, p.k) for p in parts}
    if len(kinds) != 1:
        parts = [Linear.dense(p.dequantize(), p.bias) for p in parts]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts).contiguous()  # noqa: E731
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.n) for p in parts])
    fmts = {p.fmt for p in parts}
    fmt = parts[0].fmt if len(fmts) == 1 else Q4_F32   # mixed 4-bit sources share one layout
    return Linear(sum(p.n for p in parts), parts[0].k, cat([p.data for p in parts]), fmt,
                  cat([p.scale for p in parts]), cat([p.min for p in parts]), bias)
