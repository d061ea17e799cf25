"""Weight matrices, packed or dense, and their products with activations.

A `Linear` holds an [N, K] weight either as a dense float32 tensor or, packed, as ggml blocks of
32 weights (the bytes of the GGUF file, row by row), one of:
  Q4_0 (18 B/block), Q4_1 (20 B), Q8_0 (34 B), and Q4_F32 (24 B: fp32 scale, fp32 min, 16 bytes of
  nibbles), which is how Q4_K's 6-bit sub-block scales are re-blocked at load without loss.
`dequantize()` reproduces GGUF's reference dequantization (d*q + m in float32) bit for bit; the
native kernels multiply the packed bytes directly, for decode and prefill alike.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from slipstream.kernels.cpu import load_library

Q4_0, Q4_1, Q8_0, Q4_F32 = 2, 3, 8, 100
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_F32: 24}
FORMAT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_F32: "Q4_F32"}


@dataclass
class Linear:
    n: int                              # output features
    k: int                              # input features
    data: torch.Tensor                  # float32 [N, K], or uint8 [N, K/32 * block bytes]
    fmt: int | None = None              # None = dense float32, else one of the block formats
    bias: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.fmt is not None

    @property
    def nbytes(self) -> int:
        b = self.data.numel() * self.data.element_size()
        return b + (0 if self.bias is None else self.bias.numel() * 4)

    @staticmethod
    def dense(w: torch.Tensor, bias: torch.Tensor | None = None) -> "Linear":
        w = w.to(torch.float32).contiguous()
        return Linear(w.shape[0], w.shape[1], w, None,
                      None if bias is None else bias.to(torch.float32).contiguous())

    @staticmethod
    def from_blocks(fmt: int, blocks: np.ndarray | torch.Tensor, n: int, k: int) -> "Linear":
        if k % 32:
            raise ValueError(f"packed weights need K divisible by 32, got {k}")
        with warnings.catch_warnings():  # a read-only memory map of the file: we never write to it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.as_tensor(np.ascontiguousarray(blocks)).view(torch.uint8).reshape(n, -1)
        if t.shape[1] != k // 32 * BLOCK_BYTES[fmt]:
            raise ValueError(f"{FORMAT_NAMES[fmt]} row of {k} weights needs {k // 32 * BLOCK_BYTES[fmt]} bytes")
        return Linear(n, k, t.contiguous(), fmt)

    def select_rows(self, rows: torch.Tensor) -> "Linear":
        return Linear(int(rows.numel()), self.k, self.data[rows].contiguous(), self.fmt,
                      None if self.bias is None else self.bias[rows].contiguous())

    # -- maths ------------------------------------------------------------------------------------
    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, K] (or the given rows), equal to GGUF's dequantization bit for bit."""
        data = self.data if rows is None else self.data[rows]
        if self.fmt is None:
            return data
        n = data.shape[0]
        blocks = data.view(n, self.k // 32, BLOCK_BYTES[self.fmt])
        if self.fmt == Q8_0:
            d = blocks[..., 0:2].contiguous().view(torch.float16).to(torch.float32)
            q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
            return (d * q).view(n, self.k)
        if self.fmt == Q4_F32:
            d = blocks[..., 0:4].contiguous().view(torch.float32)
            m = blocks[..., 4:8].contiguous().view(torch.float32)
            qs = blocks[..., 8:]
        else:
            d = blocks[..., 0:2].contiguous().view(torch.float16).to(torch.float32)
            m = blocks[..., 2:4].contiguous().view(torch.float16).to(torch.float32) if self.fmt == Q4_1 else None
            qs = blocks[..., 4:] if self.fmt == Q4_1 else blocks[..., 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.float32)
        if self.fmt == Q4_0:
            return (d * (q - 8)).view(n, self.k)
        return (d * q + m).view(n, self.k)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 accumulate: bool = False) -> torch.Tensor:
        """y = x @ W.T (+ bias) for x [rows, K]; with accumulate=True adds into `out` (residual add)."""
        lib = load_library() if self.fmt is not None else None
        if lib is None:
            w = self.data if self.fmt is None else self.dequantize()
            y = torch.nn.functional.linear(x, w, self.bias)
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
        if out is None:
            out = torch.empty(rows, self.n, dtype=torch.float32)
            accumulate = False
        scratch = torch.empty(rows * (self.k // 32), dtype=torch.float32)
        lib.gguf_matvec(self.fmt, x.data_ptr(), rows, self.k, self.data.data_ptr(), self.n,
                        out.data_ptr(), int(accumulate), scratch.data_ptr())
        if self.bias is not None:
            out.add_(self.bias)
        return out


def concat_rows(parts: list[Linear]) -> Linear:
    """Stack weights over output rows (fused QKV, gate+up): one kernel call instead of several."""
    if len({(p.fmt, p.k) for p in parts}) != 1:
        parts = [Linear.dense(p.dequantize(), p.bias) for p in parts]
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.n) for p in parts])
    return Linear(sum(p.n for p in parts), parts[0].k, torch.cat([p.data for p in parts]).contiguous(),
                  parts[0].fmt, bias)
