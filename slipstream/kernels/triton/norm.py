"""RMSNorm fused with the residual add: x += residual; y = rmsnorm(x) * weight (one program per row).

`x` is the residual stream and is updated in place (as the engine's matvecs accumulate into it);
the statistics are taken in float32 whatever the storage dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, N, stride_x, stride_r, stride_y, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = x + r
        tl.store(x_ptr + row * stride_x + offs, x.to(x_ptr.dtype.element_ty), mask=mask)
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)  # normalise what was stored
    var = tl.sum(x * x, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, N] (updated in place to x + residual), residual [B, N] or None, weight [N].
    Returns (x, y) with y = rmsnorm(x) * weight in `out` (or a new tensor of x's dtype)."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
    B, N = x.shape
    y = torch.empty_like(x) if out is None else out
    r = x if residual is None else residual
    assert r.stride(1) == 1 and y.stride(1) == 1
    _add_rmsnorm_kernel[(B,)](x, r, weight, y, N, x.stride(0), r.stride(0), y.stride(0), float(eps),
                              HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(N))
    return x, y


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: returns (x + residual, rmsnorm(x + residual) * weight); does not modify x."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    y = F.rms_norm(h.float(), (h.shape[-1],), weight.float(), eps).to(x.dtype)
    return h, y
