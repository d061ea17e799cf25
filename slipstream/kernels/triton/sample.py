"""Greedy token selection on the device (the graph runtime's), one program per row of logits [B, V]:
argmax per row, the lowest index on ties (as `torch.argmax` on CPU). No host synchronisation; all
shapes are static. (Sampling stays on the host: `engine/sampling.py`.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        x = tl.load(x_ptr + row * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        mx = tl.max(x, axis=0)
        i = tl.min(tl.where(x == mx, idx, V), axis=0)
        take = (mx > best) & (i < V)
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, mx, best)
    tl.store(out_ptr + row, best_i.to(out_ptr.dtype.element_ty))


def _block(V: int, block: int) -> int:
    return min(block, triton.next_power_of_2(V))


def greedy(logits: torch.Tensor, out: torch.Tensor | None = None, block: int = 4096) -> torch.Tensor:
    """logits [B, V] -> int64 [B]."""
    assert logits.stride(1) == 1
    B, V = logits.shape
    o = torch.empty(B, dtype=torch.int64, device=logits.device) if out is None else out
    _argmax_kernel[(B,)](logits, o, V, logits.stride(0), BLOCK=_block(V, block))
    return o


def greedy_ref(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    mx = x.max(dim=-1, keepdim=True).values
    idx = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(x == mx, idx, x.shape[-1]).min(dim=-1).values
