"""Torch references of the native CPU kernels, operator by operator (used by the tests).

They spell out the maths the C code must match; the model's eager path (models/llama.py) is the
same maths composed into a whole step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with halves (HF's rotate_half); cos/sin [T, D/2] broadcast over heads."""
    h = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def rope_store(qkv: torch.Tensor, H: int, KVH: int, D: int, cos: torch.Tensor, sin: torch.Tensor,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
               slots: torch.Tensor, kcache: torch.Tensor, vcache: torch.Tensor) -> torch.Tensor:
    """Returns the rotated q [T, H, D]; writes rotated k and v into the caches at `slots`."""
    T = qkv.shape[0]
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
    if q_norm is not None:
        q, k = rmsnorm(q, q_norm, eps), rmsnorm(k, k_norm, eps)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    kcache[slots] = k
    vcache[slots] = v
    return q


def attn_decode(q: torch.Tensor, kcache: torch.Tensor, vcache: torch.Tensor,
                seq_slots: list[torch.Tensor], scale: float) -> torch.Tensor:
    """q [S, H, D]: one query per sequence against the cache slots it owns -> [S, H, D]."""
    out = []
    for s, slots in enumerate(seq_slots):
        k, v = kcache[slots].transpose(0, 1), vcache[slots].transpose(0, 1)   # [KVH, n, D]
        qs = q[s][:, None, :]                                                  # [H, 1, D]
        out.append(F.scaled_dot_product_attention(qs, k, v, scale=scale,
                                                  enable_gqa=True)[:, 0, :])
    return torch.stack(out)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    f = gu.shape[-1] // 2
    return F.silu(gu[:, :f]) * gu[:, f:]
