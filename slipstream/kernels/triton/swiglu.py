"""SwiGLU on the fused gate/up buffer: out = silu(gu[:, :F]) * gu[:, F:]."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, F_dim, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F_dim
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + F_dim + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gu: torch.Tensor, out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """gu [B, 2F] -> [B, F]."""
    assert gu.dim() == 2 and gu.stride(1) == 1 and gu.shape[1] % 2 == 0
    B, F2 = gu.shape
    f = F2 // 2
    y = torch.empty((B, f), dtype=gu.dtype, device=gu.device) if out is None else out
    block = min(block, triton.next_power_of_2(f))
    _swiglu_kernel[(B, triton.cdiv(f, block))](gu, y, f, gu.stride(0), y.stride(0), BLOCK=block)
    return y


def swiglu_ref(gu: torch.Tensor) -> torch.Tensor:
    f = gu.shape[1] // 2
    g = gu[:, :f].float()
    return (F.silu(g) * gu[:, f:].float()).to(gu.dtype)
