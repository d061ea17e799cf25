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
                seq_slots: list[torch.Tensor], scale: float, cap: float = 0.0) -> torch.Tensor:
    """q [S, H, D]: one query per sequence against the cache slots it owns -> [S, H, D]. cap > 0: the
    scores soft-capped, cap * tanh(s / cap), before the softmax (Gemma 2)."""
    out = []
    for s, slots in enumerate(seq_slots):
        k, v = kcache[slots].transpose(0, 1), vcache[slots].transpose(0, 1)   # [KVH, n, D]
        qs = q[s][:, None, :]                                                  # [H, 1, D]
        if cap > 0:
            group = q.shape[1] // k.shape[0]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            scores = qs @ k.transpose(1, 2) * scale                            # [H, 1, n]
            out.append((torch.softmax(cap * torch.tanh(scores / cap), dim=-1) @ v)[:, 0, :])
            continue
        out.append(F.scaled_dot_product_attention(qs, k, v, scale=scale,
                                                  enable_gqa=True)[:, 0, :])
    return torch.stack(out)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    f = gu.shape[-1] // 2
    return F.silu(gu[:, :f]) * gu[:, f:]


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fast path's activation quantization, per group of 32 (ggml's Q8 blocks): d = max|x| / 127,
    q = round-half-even(x * 127 / max|x|); returns q int8 [R, K], d [R, K/32], s = d * sum(q) [R, K/32]."""
    R, K = x.shape
    g = x.view(R, K // 32, 32)
    amax = g.abs().amax(-1)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None]).to(torch.int32)
    s = d * q.sum(-1).to(torch.float32)
    return q.to(torch.int8).view(R, K), d, s


def product_q8(w_dequant_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
               x: torch.Tensor) -> torch.Tensor:
    """The fast path's product: weights as (codes [N, K] float, scale [N, K/32], min [N, K/32] or
    None) against activations quantized by `quantize_q8`: per group
    scale * d * sum(q_w * q_x) + min * d * sum(q_x), in float64 (the kernels differ only by
    fp32 summation order)."""
    codes, scale, mn = w_dequant_parts
    N, K = codes.shape
    q, d, s = quantize_q8(x)
    dots = torch.einsum("ngk,rgk->rng", codes.view(N, K // 32, 32).double(), q.view(-1, K // 32, 32).double())
    out = (dots * scale.double()[None] * d.double()[:, None, :]).sum(-1)
    if mn is not None:
        out = out + s.double() @ mn.double().T
    return out.float()
