"""Packed weight tensors and their matrix-vector products.

A `Linear` holds an [N, K] weight in one of three forms:
  - "f32": a dense float32 tensor (also used for F16/BF16 and formats we dequantize at load);
  - "q4": 4-bit codes in groups of 32 with a float32 scale and min per group (GGUF Q4_0, Q4_1, Q4_K);
  - "q8": 8-bit codes in groups of `gs` with a float32 scale (GGUF Q8_0).
Scales are stored as float32 so that d*q+m equals GGUF's own dequantization bit for bit.
Decode (few rows of activations) runs the native kernels on the packed bytes; prefill (many rows)
dequantizes once per call and uses a dense matmul, where compute, not bytes, is the limit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.kernels.cpu import load_library

MAX_NATIVE_ROWS = 8     # the kernels keep one accumulator per activation row in registers
DENSE_FROM_ROWS = 16    # beyond this many rows a dense matmul over dequantized weights wins


@dataclass
class Linear:
    kind: str                       # "f32" | "q4" | "q8"
    n: int                          # output features
    k: int                          # input features
    data: torch.Tensor              # f32 [N,K] | uint8 [N,K/2] | int8 [N,K]
    scale: torch.Tensor | None = None   # float32 [N, K/gs]
    min: torch.Tensor | None = None     # float32 [N, K/gs] or None
    gs: int = 32
    bias: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.min, self.bias)
                   if t is not None)

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def dense(w: torch.Tensor, bias: torch.Tensor | None = None) -> "Linear":
        w = w.to(torch.float32).contiguous()
        return Linear("f32", w.shape[0], w.shape[1], w,
                      bias=None if bias is None else bias.to(torch.float32).contiguous())

    @staticmethod
    def q4(codes: np.ndarray, scale: np.ndarray, minv: np.ndarray) -> "Linear":
        """codes: uint8 [N, K] in 0..15 (natural order); scale/min: [N, K/32]."""
        n, k = codes.shape
        g = codes.reshape(n, k // 32, 2, 16)
        packed = (g[:, :, 0, :] | (g[:, :, 1, :] << 4)).astype(np.uint8).reshape(n, k // 2)
        return Linear("q4", n, k, torch.from_numpy(np.ascontiguousarray(packed)),
                      torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
                      torch.from_numpy(np.ascontiguousarray(minv, dtype=np.float32)))

    @staticmethod
    def q8(codes: np.ndarray, scale: np.ndarray, gs: int = 32) -> "Linear":
        n, k = codes.shape
        return Linear("q8", n, k, torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int8)),
                      torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)), gs=gs)

    def codes(self) -> torch.Tensor:
        """Integer codes [N, K] in natural order (as int16 for q4 so arithmetic is safe)."""
        if self.kind == "q4":
            p = self.data.view(self.n, self.k // 32, 16)
            lo, hi = (p & 15), (p >> 4)
            return torch.stack([lo, hi], dim=2).reshape(self.n, self.k).to(torch.int16)
        if self.kind == "q8":
            return self.data
        raise TypeError("dense weights have no codes")

    # -- maths -------------------------------------------------------------------------------
    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, K] (or the given rows): d*q + m, the same expression as GGUF's reference."""
        if self.kind == "f32":
            return self.data if rows is None else self.data[rows]
        sub = self if rows is None else self.select_rows(rows)
        q = sub.codes().to(torch.float32).view(sub.n, sub.k // sub.gs, sub.gs)
        w = q * sub.scale.unsqueeze(-1)
        if sub.min is not None:
            w = w + sub.min.unsqueeze(-1)
        return w.view(sub.n, sub.k)

    def select_rows(self, rows: torch.Tensor) -> "Linear":
        pick = lambda t: None if t is None else t[rows].contiguous()  # noqa: E731
        return Linear(self.kind, int(rows.numel()), self.k, pick(self.data), pick(self.scale),
                      pick(self.min), self.gs, pick(self.bias))

    def permute_rows(self, perm: torch.Tensor) -> "Linear":
        return self.select_rows(perm)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 accumulate: bool = False) -> torch.Tensor:
        """y = x @ W.T (+ bias); with accumulate=True adds into `out` (a fused residual add)."""
        rows = x.shape[0]
        lib = load_library() if self.kind != "f32" and rows <= DENSE_FROM_ROWS else None
        if lib is None:
            y = torch.nn.functional.linear(x, self.dequantize(), self.bias)
            if out is None:
                return y
            return out.add_(y) if accumulate else out.copy_(y)
        x = x.contiguous()
        if out is None:
            out = torch.empty(rows, self.n, dtype=torch.float32)
            accumulate = False
        for r0 in range(0, rows, MAX_NATIVE_ROWS):
            b = min(MAX_NATIVE_ROWS, rows - r0)
            xp = x.data_ptr() + r0 * self.k * 4
            yp = out.data_ptr() + r0 * self.n * 4
            if self.kind == "q4":
                lib.q4_matvec(xp, b, self.k, self.data.data_ptr(), self.scale.data_ptr(),
                              self.min.data_ptr(), self.n, yp, int(accumulate))
            else:
                lib.q8_matvec(xp, b, self.k, self.data.data_ptr(), self.scale.data_ptr(),
                              None if self.min is None else self.min.data_ptr(), self.gs,
                              self.n, yp, int(accumulate))
        if self.bias is not None:
            out.add_(self.bias)
        return out


def concat_rows(parts: list[Linear]) -> Linear:
    """Stack several weights over output rows (fused QKV, gate+up): one kernel call instead of many."""
    kinds = {(p.kind, p.k, p.gs, p.min is None) for p in parts}
    if len(kinds) != 1:
        parts = [Linear.dense(p.dequantize(), p.bias) for p in parts]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts).contiguous()  # noqa: E731
    biases = [p.bias for p in parts]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(p.n) for b, p in zip(biases, parts)])
    first = parts[0]
    return Linear(first.kind, sum(p.n for p in parts), first.k, cat([p.data for p in parts]),
                  cat([p.scale for p in parts]), cat([p.min for p in parts]), first.gs, bias)
