"""DSA (DeepSeek Sparse Attention) decode: lightning-indexer scores and top-k token selection.

Maths (as `DeepseekModel._index` for one query token):

    score[t] = sum_h  w[h] * relu((q[h] . k[slot(t)]) * scale),     t < context

with q = the indexer query [Hi, Di] (rotary part already applied),
k = `LatentKVCache.index_k[layer]`
[slots, Di], w = `weights_proj(h) * Hi**-0.5` (the eager code folds Hi**-0.5 into w) and
scale = Di**-0.5. The selection is the positions of the `topk` largest scores; ties are broken
towards the lowest position (the set torch.topk returns in the absence of ties). Positions come out
in ascending order (a set; attention does not care about order), -1 past min(topk, context).
Attention over the selection is `mla.mla_decode(..., slots=positions_to_slots(...))`.

Kernels:
  1. `_index_score_kernel`, grid (B, cdiv(max_len, BLOCK_N)): a tile of context positions per
     program, all Hi heads at once with tl.dot ([Hi, Di] x [Di, N]), relu, weighted head sum;
     positions past the context get -inf.
  2. `_topk_kernel`, grid (B,): one program per sequence finds the k-th largest score exactly by
     bisection on the order-preserving int32 image of the float bits (32 counting passes over the
     scores, which sit in L2), then compacts the selected positions in order with a running
     cumsum: all scores above the threshold, and the first (k - #above) positions equal to it.
  This is exact for any context length and needs no sort; for 128K-token contexts one program per
  sequence does ~33 passes over 512 KB, a radix-select split over several programs is the
  obvious improvement if it shows in profiles.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


# -- references ----------------------------------------------------------------------------------
def index_scores_reference(q: torch.Tensor, k_cache: torch.Tensor, head_w: torch.Tensor,
                           slots: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, max_len] fp32 scores (-inf past each context), the eager `_index` maths."""
    B, n = slots.shape
    out = torch.full((B, n), float("-inf"))
    for b in range(B):
        L = int(lens[b])
        keys = k_cache.index_select(0, slots[b, :L].long()).float()
        per_head = torch.relu(torch.einsum("hd,cd->hc", q[b].float(), keys) * scale)
        out[b, :L] = torch.einsum("h,hc->c", head_w[b].float(), per_head)
    return out


def topk_reference(scores: torch.Tensor, lens: torch.Tensor, topk: int) -> torch.Tensor:
    """[B, topk] ascending positions of the topk largest scores (ties: lowest position), -1 pad."""
    B = scores.shape[0]
    out = torch.full((B, topk), -1, dtype=torch.int64)
    for b in range(B):
        L = int(lens[b])
        s = scores[b, :L].double()
        kk = min(topk, L)
        # stable sort on (-score): equal scores keep position order, so lowest positions win ties
        order = torch.sort(-s, stable=True).indices[:kk]
        out[b, :kk] = order.sort().values
    return out


def positions_to_slots(positions: torch.Tensor, block_table: torch.Tensor, block_size: int
                       ) -> torch.Tensor:
    """Context positions (-1 = none) -> cache slots through a block table (-1 kept)."""
    p = positions.long().clamp_min(0)
    slots = block_table.long().gather(1, p // block_size) * block_size + p % block_size
    return torch.where(positions >= 0, slots, torch.full_like(slots, -1))


# -- kernels -------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _index_score_kernel(q_ptr, k_ptr, w_ptr, bt_ptr, lens_ptr, out_ptr,
                            Hi, Di, bt_stride, out_stride, scale,
                            BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        b = tl.program_id(0)
        nb = tl.program_id(1)
        length = tl.load(lens_ptr + b)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = offs_n < length
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mh = offs_h < Hi
        md = offs_d < Di
        blk = tl.load(bt_ptr + b * bt_stride + offs_n // BLOCK_SIZE, mask=mn, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        q = tl.load(q_ptr + (b * Hi + offs_h[:, None]) * Di + offs_d[None, :],
                    mask=mh[:, None] & md[None, :], other=0.0)
        k = tl.load(k_ptr + slot[:, None] * Di + offs_d[None, :],
                    mask=mn[:, None] & md[None, :], other=0.0)
        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PREC)        # [H, N]
        s = tl.maximum(s * scale, 0.0)
        w = tl.load(w_ptr + b * Hi + offs_h, mask=mh, other=0.0).to(tl.float32)
        score = tl.sum(s * w[:, None], axis=0)
        score = tl.where(mn, score, -float("inf"))
        tl.store(out_ptr + b * out_stride + offs_n, score, mask=offs_n < out_stride)

    @triton.jit
    def _topk_kernel(s_ptr, lens_ptr, out_ptr, s_stride, TOPK,
                     BLOCK: tl.constexpr):
        b = tl.program_id(0)
        length = tl.load(lens_ptr + b)
        kk = tl.minimum(TOPK, length)
        lo = tl.full([], -2147483648, tl.int64)       # count(key >= lo) >= kk always
        hi = tl.full([], 2147483648, tl.int64)        # count(key >= hi) == 0 < kk
        for _ in range(32):
            mid = (lo + hi) >> 1
            cnt = tl.zeros([], dtype=tl.int32)
            for n0 in range(0, length, BLOCK):
                offs = n0 + tl.arange(0, BLOCK)
                m = offs < length
                v = tl.load(s_ptr + b * s_stride + offs, mask=m, other=0.0)
                v = tl.where(v == 0.0, 0.0, v)  # -0 == +0
                bits = v.to(tl.int32, bitcast=True)
                key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
                cnt += tl.sum((m & (key.to(tl.int64) >= mid)).to(tl.int32), axis=0)
            take = cnt >= kk
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid)
        thr = lo
        # how many above the threshold, so how many ties to take
        above = tl.zeros([], dtype=tl.int32)
        for n0 in range(0, length, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            m = offs < length
            v = tl.load(s_ptr + b * s_stride + offs, mask=m, other=0.0)
            v = tl.where(v == 0.0, 0.0, v)  # -0 == +0
            bits = v.to(tl.int32, bitcast=True)
            key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
            above += tl.sum((m & (key > thr)).to(tl.int32), axis=0)
        ties = kk - above
        pos = tl.zeros([], dtype=tl.int32)
        tie_seen = tl.zeros([], dtype=tl.int32)
        for n0 in range(0, length, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            m = offs < length
            v = tl.load(s_ptr + b * s_stride + offs, mask=m, other=0.0)
            v = tl.where(v == 0.0, 0.0, v)  # -0 == +0
            bits = v.to(tl.int32, bitcast=True)
            key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
            eq = (m & (key == thr)).to(tl.int32)
            tie_rank = tie_seen + tl.cumsum(eq, axis=0) - eq              # exclusive
            sel = (m & (key > thr)) | ((eq > 0) & (tie_rank < ties))
            sel_i = sel.to(tl.int32)
            dst = pos + tl.cumsum(sel_i, axis=0) - sel_i
            tl.store(out_ptr + b * TOPK + dst, offs.to(tl.int64), mask=sel)
            pos += tl.sum(sel_i, axis=0)
            tie_seen += tl.sum(eq, axis=0)
        for n0 in range(kk, TOPK, BLOCK):                                  # pad with -1
            offs = n0 + tl.arange(0, BLOCK)
            tl.store(out_ptr + b * TOPK + offs, tl.full([BLOCK], -1, tl.int64), mask=offs < TOPK)


def index_scores(q: torch.Tensor, k_cache: torch.Tensor, head_w: torch.Tensor,
                 block_table: torch.Tensor, lens: torch.Tensor, scale: float, *,
                 block_size: int = 16, max_len: int | None = None, block_n: int = 32
                 ) -> torch.Tensor:
    """Indexer scores [B, max_len] fp32 (-inf past each context). q [B, Hi, Di], head_w [B, Hi]."""
    assert triton is not None, "triton is not installed"
    B, Hi, Di = q.shape
    bt = block_table.to(torch.int32).contiguous()
    max_len = bt.shape[1] * block_size if max_len is None else max_len
    out = torch.empty((B, max_len), dtype=torch.float32, device=q.device)
    prec = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    _index_score_kernel[(B, triton.cdiv(max_len, block_n))](
        q.contiguous(), k_cache.contiguous(), head_w.contiguous(), bt,
        lens.to(torch.int32).contiguous(), out, Hi, Di, bt.stride(0), max_len, float(scale),
        BLOCK_SIZE=block_size, BLOCK_H=max(16, triton.next_power_of_2(Hi)),
        BLOCK_D=max(16, triton.next_power_of_2(Di)), BLOCK_N=block_n, PREC=prec)
    return out


def topk_select(scores: torch.Tensor, lens: torch.Tensor, topk: int, block: int = 256
                ) -> torch.Tensor:
    """[B, topk] int64 ascending positions of the topk best scores per row (-1 padded)."""
    assert triton is not None, "triton is not installed"
    scores = scores.float().contiguous()
    B = scores.shape[0]
    out = torch.empty((B, topk), dtype=torch.int64, device=scores.device)
    _topk_kernel[(B,)](scores, lens.to(torch.int32).contiguous(), out, scores.stride(0), topk,
                       BLOCK=block)
    return out


def dsa_select(q, k_cache, head_w, block_table, lens, scale, topk, *, block_size: int = 16,
               max_len: int | None = None) -> torch.Tensor:
    """Scores then top-k: [B, topk] positions (-1 padded). Feed `positions_to_slots` to mla_decode
    with lens = min(lens, topk)."""
    s = index_scores(q, k_cache, head_w, block_table, lens, scale, block_size=block_size,
                     max_len=max_len)
    return topk_select(s, lens, topk)
