"""Split-K (flash-decoding) paged attention for GQA at decode: one query token per sequence.

Phase 1, grid (B, KVH, max_splits): each program takes one KV head, all G = H / KVH query heads
that share it (query head h reads KV head h // G, as SDPA's `enable_gqa`), and one partition of
PARTITION tokens of the sequence's context; it gathers K/V through the block table
(slot = block_table[b, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE), runs an online softmax
over tiles of BLOCK_N tokens and writes an unnormalised partial output with its running max and sum.
Partitions beyond a sequence's context write (m=-inf, l=0, acc=0). Phase 2, grid (B, H), merges
the partitions. The grid depends only on the static maximum context, so it is CUDA-graph safe.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, acc_ptr, m_ptr, l_ptr,
                               scale, stride_bt, max_splits,
                               H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                               G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                               BLOCK_N: tl.constexpr, PARTITION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    start = split * PARTITION
    end = tl.minimum(start + PARTITION, ctx)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + (b * H + heads)[:, None] * D + offs_d[None, :], mask=g_mask[:, None],
                other=0.0).to(tl.float32) * scale                           # [G_PAD, D]

    m = tl.full((G_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + offs_n
        t_mask = t < end
        block = tl.load(bt_ptr + b * stride_bt + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + t % BLOCK_SIZE
        kv_off = (slot * KVH + kvh)[:, None] * D + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=t_mask[:, None], other=0.0).to(tl.float32)   # [BLOCK_N, D]
        v = tl.load(v_ptr + kv_off, mask=t_mask[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                            # [G_PAD, BLOCK_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    part = (b * H + heads) * max_splits + split                                       # [G_PAD]
    tl.store(m_ptr + part, m, mask=g_mask)
    tl.store(l_ptr + part, l, mask=g_mask)
    tl.store(acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _paged_decode_reduce_kernel(acc_ptr, m_ptr, l_ptr, ctx_ptr, out_ptr, max_splits,
                                H: tl.constexpr, D: tl.constexpr, PARTITION: tl.constexpr,
                                SPLIT_BLOCK: tl.constexpr):
    """Merges a (sequence, head)'s partitions SPLIT_BLOCK at a time (two passes: the global max,
    then the rescaled sums), so a long context never needs all partitions in registers at once."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    n_splits = tl.cdiv(ctx, PARTITION)
    offs_s = tl.arange(0, SPLIT_BLOCK)
    offs_d = tl.arange(0, D)
    base = (b * H + h) * max_splits
    m_run = tl.full((SPLIT_BLOCK,), float("-inf"), tl.float32)
    for s0 in range(0, n_splits, SPLIT_BLOCK):
        s_mask = s0 + offs_s < n_splits
        m_run = tl.maximum(m_run, tl.load(m_ptr + base + s0 + offs_s, mask=s_mask, other=float("-inf")))
    m_all = tl.max(m_run, axis=0)
    num = tl.zeros((D,), tl.float32)
    den = tl.zeros((SPLIT_BLOCK,), tl.float32)
    for s0 in range(0, n_splits, SPLIT_BLOCK):
        s_mask = s0 + offs_s < n_splits
        m = tl.load(m_ptr + base + s0 + offs_s, mask=s_mask, other=float("-inf"))
        l = tl.load(l_ptr + base + s0 + offs_s, mask=s_mask, other=0.0)
        w = tl.where(s_mask, tl.exp(m - m_all), 0.0)
        acc = tl.load(acc_ptr + (base + s0 + offs_s)[:, None] * D + offs_d[None, :], mask=s_mask[:, None],
                      other=0.0)
        num += tl.sum(acc * w[:, None], axis=0)
        den += l * w
    o = num / tl.sum(den, axis=0)
    tl.store(out_ptr + (b * H + h) * D + offs_d, o.to(out_ptr.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, max_context: int,
                           scale: float | None = None, block_size: int = 16, partition: int = 256,
                           block_n: int = 16, out: torch.Tensor | None = None,
                           workspace: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """q [B, H, D]; k_cache/v_cache [slots, KVH, D]; block_tables [B, max_blocks] (int32/int64);
    context_lens [B] (int32, >= 1, including the token just appended); max_context: a static upper
    bound on context_lens (sets the grid). Returns [B, H, D] in q's dtype."""
    B, H, D = q.shape
    KVH = k_cache.shape[1]
    assert H % KVH == 0 and D & (D - 1) == 0 and q.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
    assert partition % block_n == 0
    G = H // KVH
    max_splits = triton.cdiv(max_context, partition)
    if workspace is None:
        acc = torch.empty((B, H, max_splits, D), dtype=torch.float32, device=q.device)
        m = torch.empty((B, H, max_splits), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
    else:
        acc, m, l = workspace
    o = torch.empty_like(q) if out is None else out
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _paged_decode_split_kernel[(B, KVH, max_splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, m, l, float(scale),
        block_tables.stride(0), max_splits, H=H, KVH=KVH, D=D, G=G,
        G_PAD=max(triton.next_power_of_2(G), 1), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        PARTITION=partition)
    _paged_decode_reduce_kernel[(B, H)](
        acc, m, l, context_lens, o, max_splits, H=H, D=D, PARTITION=partition,
        SPLIT_BLOCK=min(max(triton.next_power_of_2(max_splits), 2), 16))
    return o


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float | None = None, block_size: int = 16) -> torch.Tensor:
    """Gather each sequence's slots and run SDPA with GQA, in float32."""
    B, H, D = q.shape
    out = torch.empty_like(q)
    for b in range(B):
        n = int(context_lens[b])
        t = torch.arange(n, device=k_cache.device)
        table = block_tables[b].to(k_cache.device).long()
        slots = table[t // block_size] * block_size + t % block_size
        k = k_cache.index_select(0, slots).float().transpose(0, 1)     # [KVH, n, D]
        v = v_cache.index_select(0, slots).float().transpose(0, 1)
        qh = q[b].float()[:, None, :]                                   # [H, 1, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qh, k, v, scale=scale, enable_gqa=k.shape[0] != H)
        out[b] = o[:, 0, :].to(q.dtype)
    return out
