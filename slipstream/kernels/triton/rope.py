"""RoPE (half-rotation layout, as `LlamaModel._rope`) fused with the paged KV-cache append.

Input is the fused qkv projection [B, (H + 2*KVH) * D] of one decode step (one row per token).
One program per (token, head) over the H query heads and KVH key heads: it computes cos/sin from
the token's position and `inv_freq` [D/2] in float32, rotates, and writes q to `q_out` [B, H, D]
and k to `k_cache[slot]`; key-head programs also copy v to `v_cache[slot]`. The caches are one
layer of `PagedKVCache`: [slots, KVH, D] (slot = block * block_size + offset). Optional per-head
RMSNorm weights (Qwen3's q_norm/k_norm) are applied before the rotation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _rope_kv_append_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, slot_ptr, q_out_ptr, k_ptr, v_ptr,
                           qn_ptr, kn_ptr, stride_qkv, eps,
                           H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                           HAS_QK_NORM: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)                 # 0..H-1: query heads, H..H+KVH-1: key heads
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + row).to(tl.float32)
    freqs = pos * tl.load(inv_freq_ptr + offs).to(tl.float32)
    cos = tl.cos(freqs)
    sin = tl.sin(freqs)
    base = qkv_ptr + row * stride_qkv + head * D
    x1 = tl.load(base + offs).to(tl.float32)
    x2 = tl.load(base + HALF + offs).to(tl.float32)
    is_q = head < H
    if HAS_QK_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        if is_q:
            w1 = tl.load(qn_ptr + offs).to(tl.float32)
            w2 = tl.load(qn_ptr + HALF + offs).to(tl.float32)
        else:
            w1 = tl.load(kn_ptr + offs).to(tl.float32)
            w2 = tl.load(kn_ptr + HALF + offs).to(tl.float32)
        x1 = x1 * rstd * w1
        x2 = x2 * rstd * w2
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_q:
        dst = q_out_ptr + (row * H + head) * D
        tl.store(dst + offs, o1.to(q_out_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, o2.to(q_out_ptr.dtype.element_ty))
    else:
        kvh = head - H
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if slot >= 0:   # a negative slot is a padded row of a fixed-size (CUDA-graph) batch
            dst = k_ptr + (slot * KVH + kvh) * D
            tl.store(dst + offs, o1.to(k_ptr.dtype.element_ty))
            tl.store(dst + HALF + offs, o2.to(k_ptr.dtype.element_ty))
            offs_d = tl.arange(0, D)
            v = tl.load(qkv_ptr + row * stride_qkv + (H + KVH + kvh) * D + offs_d)
            tl.store(v_ptr + (slot * KVH + kvh) * D + offs_d, v.to(v_ptr.dtype.element_ty))


def rope_kv_append(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int,
                   q_out: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                   k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """qkv [B, (H+2KVH)*D], positions [B] (int), inv_freq [D/2] float32, slots [B] (int, < 0: no store),
    k_cache/v_cache [slots, KVH, D] contiguous. Writes k/v in place; returns q [B, H, D]."""
    H, KVH, D = num_heads, num_kv_heads, head_dim
    B = qkv.shape[0]
    assert qkv.shape[1] == (H + 2 * KVH) * D and qkv.stride(1) == 1
    assert D & (D - 1) == 0, "head_dim must be a power of two"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1:] == (KVH, D)
    q = torch.empty((B, H, D), dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    assert q.is_contiguous()
    has_norm = q_norm is not None
    _rope_kv_append_kernel[(B, H + KVH)](
        qkv, positions, inv_freq, slots, q, k_cache, v_cache,
        q_norm if has_norm else inv_freq, k_norm if has_norm else inv_freq,
        qkv.stride(0), float(eps), H=H, KVH=KVH, D=D, HAS_QK_NORM=has_norm)
    return q


def rope_kv_append_ref(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                       slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int,
                       q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                       eps: float = 1e-6) -> torch.Tensor:
    """The eager model's maths (`_rope_tables`, `_rope`, `index_copy_`), in place on the caches."""
    H, KVH, D = num_heads, num_kv_heads, head_dim
    B = qkv.shape[0]
    x = qkv.float()
    q = x[:, :H * D].view(B, H, D)
    k = x[:, H * D:(H + KVH) * D].view(B, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(B, KVH, D)
    if q_norm is not None:
        q = F.rms_norm(q, (D,), q_norm.float(), eps)
        k = F.rms_norm(k, (D,), k_norm.float(), eps)
    freqs = positions.to(torch.float32)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

    def rot(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

    keep = slots >= 0   # negative slots: padded rows that store nothing
    k_cache.index_copy_(0, slots[keep].long(), rot(k)[keep].to(k_cache.dtype))
    v_cache.index_copy_(0, slots[keep].long(), v[keep].to(v_cache.dtype))
    return rot(q).to(qkv.dtype)
