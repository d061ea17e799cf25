"""MLA absorbed decode attention over the paged latent cache (split-K / flash-decoding).

Maths (as `DeepseekModel._mla_absorbed`, one query token per sequence):

    scores[h, t] = (q_abs[h] . latent[slot(t)] + q_pe[h] . k_pe[slot(t)]) * scale
    out[h]       = softmax_t(scores[h]) @ latent[slot(t)]          # [H, R], W_uv applied after

q_abs = q_nope @ W_uk (absorbed, [B, H, R]); q_pe is already rotated ([B, H, P]); `scale` is the
model's softmax scale (`DeepseekModel.scale`, YaRN mscale included). The cache is
`LatentKVCache.latent[layer]` [slots, R] and `.rope[layer]` [slots, P].

Which slots a sequence reads is given either by a block table ([B, max_blocks] int32, token t of
sequence b lives in slot table[b, t // block_size] * block_size + t % block_size, for t < lens[b])
or by an explicit slot list ([B, max_len] int32, lens[b] valid entries): the DSA path passes the
slots of its top-k selection (see `dsa.positions_to_slots`).

Design: grid (B, cdiv(H, BLOCK_H), num_splits). A program takes a group of heads (all heads read
the same latent, so each latent tile is loaded once per head group, which is what makes MLA decode
cheap) and one contiguous chunk of the context, runs an online softmax with tl.dot over BLOCK_N
tokens at a time and writes an unnormalised-free partial (o / l, plus log-sum-exp). A second
kernel, grid (B, H), merges the splits with their LSE weights. Empty splits write lse = -inf and
are weighted 0. Head, rope and rank dims are padded to >= 16 (tl.dot's minimum) with masks.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


# -- references ----------------------------------------------------------------------------------
def block_table_to_slots(block_table: torch.Tensor, lens: torch.Tensor, block_size: int,
                         max_len: int | None = None) -> torch.Tensor:
    """[B, max_len] slot ids (-1 beyond each length) from a block table."""
    B = block_table.shape[0]
    n = int(lens.max()) if max_len is None else max_len
    t = torch.arange(n, device=block_table.device)
    blk = block_table.long().gather(1, (t // block_size).clamp_max(block_table.shape[1] - 1)
                                    .expand(B, n))
    slots = blk * block_size + t % block_size
    return torch.where(t[None, :] < lens.long()[:, None], slots, torch.full_like(slots, -1))


def mla_decode_reference(q_abs: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                         k_pe: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """The eager maths of `_mla_absorbed` up to W_uv, per sequence, in fp32. [B, H, R]."""
    outs = []
    for b in range(q_abs.shape[0]):
        idx = slots[b, : int(lens[b])].long()
        lat, pe = latent.index_select(0, idx).float(), k_pe.index_select(0, idx).float()
        s = (q_abs[b].float() @ lat.T + q_pe[b].float() @ pe.T) * scale
        outs.append(torch.softmax(s, dim=-1) @ lat)
    return torch.stack(outs)


# -- kernels -------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _mla_split_kernel(q_ptr, qpe_ptr, lat_ptr, pe_ptr, map_ptr, lens_ptr, o_ptr, lse_ptr,
                          H, R, P, map_stride, chunk, NS, scale,
                          PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        b = tl.program_id(0)
        hb = tl.program_id(1)
        sp = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        start = sp * chunk
        end = tl.minimum(start + chunk, length)

        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        mh = offs_h < H
        mr = offs_r < R
        mp = offs_p < P
        q = tl.load(q_ptr + (b * H + offs_h[:, None]) * R + offs_r[None, :],
                    mask=mh[:, None] & mr[None, :], other=0.0)
        qp = tl.load(qpe_ptr + (b * H + offs_h[:, None]) * P + offs_p[None, :],
                     mask=mh[:, None] & mp[None, :], other=0.0)
        q = q.to(lat_ptr.dtype.element_ty)
        qp = qp.to(pe_ptr.dtype.element_ty)

        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mn = offs_n < end
            if PAGED:
                blk = tl.load(map_ptr + b * map_stride + offs_n // BLOCK_SIZE, mask=mn, other=0)
                slot = blk.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
            else:
                slot = tl.load(map_ptr + b * map_stride + offs_n, mask=mn, other=0).to(tl.int64)
            lat = tl.load(lat_ptr + slot[:, None] * R + offs_r[None, :],
                          mask=mn[:, None] & mr[None, :], other=0.0)      # [N, R]
            pe = tl.load(pe_ptr + slot[:, None] * P + offs_p[None, :],
                         mask=mn[:, None] & mp[None, :], other=0.0)       # [N, P]
            s = tl.dot(q, tl.trans(lat), input_precision=PREC)
            s += tl.dot(qp, tl.trans(pe), input_precision=PREC)
            s = s * scale
            s = tl.where(mn[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PREC)
            m_i = m_new
        nonempty = end > start
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), -float("inf"))
        row = (b * H + offs_h) * NS + sp
        tl.store(o_ptr + row[:, None] * R + offs_r[None, :], o, mask=mh[:, None] & mr[None, :])
        tl.store(lse_ptr + row, lse, mask=mh)

    @triton.jit
    def _mla_merge_kernel(o_ptr, lse_ptr, out_ptr, R, NS,
                          BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
        bh = tl.program_id(0)
        offs_s = tl.arange(0, BLOCK_S)
        offs_r = tl.arange(0, BLOCK_R)
        ms = offs_s < NS
        mr = offs_r < R
        lse = tl.load(lse_ptr + bh * NS + offs_s, mask=ms, other=-float("inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == -float("inf"), 0.0, mx)
        w = tl.where(ms & (lse > -float("inf")), tl.exp(lse - mx), 0.0)
        tot = tl.sum(w, axis=0)
        w = w / tl.where(tot > 0, tot, 1.0)
        o = tl.load(o_ptr + (bh * NS + offs_s[:, None]) * R + offs_r[None, :],
                    mask=ms[:, None] & mr[None, :], other=0.0)
        res = tl.sum(o * w[:, None], axis=0)
        tl.store(out_ptr + bh * R + offs_r, res.to(out_ptr.dtype.element_ty), mask=mr)


def mla_decode(q_abs: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
               lens: torch.Tensor, scale: float, *, block_table: torch.Tensor | None = None,
               block_size: int = 16, slots: torch.Tensor | None = None, max_len: int | None = None,
               num_splits: int | None = None, block_n: int = 16, block_h: int = 16) -> torch.Tensor:
    """Absorbed MLA decode: [B, H, R] in q_abs's dtype. Exactly one of block_table / slots.

    `max_len` bounds the context lengths (defaults to the table's capacity, never read from the
    device, so the launch stays graph-capturable); num_splits defaults to cdiv(max_len, 256).
    """
    assert triton is not None, "triton is not installed"
    assert (block_table is None) != (slots is None)
    B, H, R = q_abs.shape
    P = q_pe.shape[-1]
    paged = block_table is not None
    mapping = (block_table if paged else slots).to(torch.int32).contiguous()
    cap = mapping.shape[1] * (block_size if paged else 1)
    max_len = cap if max_len is None else max_len
    ns = num_splits or max(1, triton.cdiv(max_len, 256))
    chunk = triton.cdiv(triton.cdiv(max_len, ns), block_n) * block_n
    dev = q_abs.device
    o_part = torch.empty((B, H, ns, R), dtype=torch.float32, device=dev)
    lse = torch.empty((B, H, ns), dtype=torch.float32, device=dev)
    prec = "ieee" if latent.dtype == torch.float32 else "tf32"
    BR = max(16, triton.next_power_of_2(R))
    BP = max(16, triton.next_power_of_2(P))
    BH = max(16, min(block_h, triton.next_power_of_2(H)))
    _mla_split_kernel[(B, triton.cdiv(H, BH), ns)](
        q_abs.contiguous(), q_pe.contiguous(), latent.contiguous(), k_pe.contiguous(), mapping,
        lens.to(torch.int32).contiguous(), o_part, lse, H, R, P, mapping.stride(0), chunk, ns,
        float(scale), PAGED=paged, BLOCK_SIZE=block_size if paged else 1, BLOCK_H=BH, BLOCK_R=BR,
        BLOCK_P=BP, BLOCK_N=block_n, PREC=prec)
    out = torch.empty((B, H, R), dtype=q_abs.dtype, device=dev)
    _mla_merge_kernel[(B * H,)](o_part, lse, out, R, ns,
                                BLOCK_S=max(2, triton.next_power_of_2(ns)), BLOCK_R=BR)
    return out
