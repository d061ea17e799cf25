"""Small-batch matrix-vector products y = x W^T (x [M, K], M of 1-8 rows; W [N, K]).

Weight formats (the same layouts as `slipstream/weights/quant.py`, so packed weights load as is):
  dense:  W bf16/fp16/fp32 [N, K]
  int8:   data int8 [N, K], scale fp32 [N, K/group] (group 32; per-row scales: scale [N] or [N, 1],
          group = K);                                           w = scale * q
  int4:   data uint8 [N, K/2], scale and min fp32 [N, K/32]; within each group of 32 weights,
          byte j (0..15) holds weight j in its low nibble and weight j+16 in its high nibble;
                                                                w = scale * q + min
Grid (cdiv(N, BLOCK_N), SPLIT_K): each program computes all M rows for one tile of N over one
K-range, accumulating in float32. With SPLIT_K > 1 the partials go to a [SPLIT_K, M, N] fp32
workspace; the last program of each N tile to finish (an int32 counter per tile, `locks`, zero
between launches) sums them in split order (deterministic) and writes the output: one launch. `accumulate=True` adds
the result into `out` (the engine's residual-add convention, `Linear(..., accumulate=True)`).
Two fusions save the decode step launches: an RMSNorm prologue (`norm_weight`: every program takes
its rows' statistics over all of K, then normalises each chunk as it loads it) and a SwiGLU
epilogue (`glu`: the tile also accumulates the matching up-projection rows of the fused gate/up
weight and stores silu(gate) * up; with split-K the reduce kernel applies it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DENSE, INT8, INT4 = 0, 1, 2


@triton.jit
def _load_w(w_ptr, s_ptr, mn_ptr, rows, offs_k, wm, K, n_groups, FMT: tl.constexpr, GROUP: tl.constexpr):
    """A [rows, K-chunk] tile of weights, widened to float32 (dense, int8 or int4 codes)."""
    if FMT == 0:
        w = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=wm, other=0.0).to(tl.float32)
    elif FMT == 1:
        q = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=wm, other=0).to(tl.float32)
        sc = tl.load(s_ptr + rows[:, None] * n_groups + (offs_k // GROUP)[None, :], mask=wm, other=0.0)
        w = q * sc
    else:
        g = offs_k // 32
        i = offs_k % 32
        byte = tl.load(w_ptr + rows[:, None] * (K // 2) + (g * 16 + i % 16)[None, :], mask=wm, other=0)
        shift = ((i >= 16).to(tl.int32) * 4)[None, :]
        q = ((byte.to(tl.int32) >> shift) & 15).to(tl.float32)
        goff = rows[:, None] * n_groups + g[None, :]
        sc = tl.load(s_ptr + goff, mask=wm, other=0.0)
        mn = tl.load(mn_ptr + goff, mask=wm, other=0.0)
        w = q * sc + mn
    return w


@triton.jit
def _load_x(x_ptr, offs_m, m_mask, stride_x, offs_k, k_mask, nw_ptr, rstd, NORM: tl.constexpr):
    """A [rows, K-chunk] tile of the activations as float32, RMS-normalised when NORM."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        x = x * rstd[:, None] * nw[None, :]
    return x


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    """acc + a @ b, float32 accumulation; F32 widens 16-bit operands first (the same products)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _dot_x(x, wt, acc, F32: tl.constexpr):
    """acc + x @ wt for float32 x and stored weights wt: float32 weights exactly (a float32 model; no
    tensor cores), 16-bit weights (exact as stored) with x as hi + lo parts in their dtype."""
    if wt.dtype == tl.float32:
        return tl.dot(x, wt, acc, input_precision="ieee")
    x_hi = x.to(wt.dtype)
    x_lo = (x - x_hi.to(tl.float32)).to(wt.dtype)
    return _dot(x_lo, wt, _dot(x_hi, wt, acc, F32), F32)


@triton.jit
def _dot_xw(x, wt, acc, F32: tl.constexpr):
    """acc + x @ wt for float32 x and dequantized float32 wt, both as bf16 hi + lo parts (lo x lo
    dropped: about 16 mantissa bits, far below the quantization's own error)."""
    x_hi = x.to(tl.bfloat16)
    x_lo = (x - x_hi.to(tl.float32)).to(tl.bfloat16)
    w_hi = wt.to(tl.bfloat16)
    w_lo = (wt - w_hi.to(tl.float32)).to(tl.bfloat16)
    return _dot(x_lo, w_hi, _dot(x_hi, w_lo, _dot(x_hi, w_hi, acc, F32), F32), F32)


@triton.jit
def _matvec_kernel(x_ptr, w_ptr, s_ptr, mn_ptr, nw_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, stride_x, stride_out,
                   k_per_split, n_groups, eps,
                   FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   ACCUMULATE: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr,
                   SPLIT_PAD: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    rstd = tl.full((BLOCK_M,), 1.0, tl.float32)   # without NORM: unused
    if NORM:   # RMSNorm prologue: each row's 1/rms over all of K (cheap next to the weights)
        ss = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                         mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(xk * xk, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if BLOCK_M == 1:
        # one row: products accumulate element-wise in the weight tile's layout and are reduced once
        # after the loop (no shuffles or barriers per K-step); x and the norm weight are loaded at the
        # tile's shape (addresses repeat along N) so that they share that layout
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        acc2_up = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        nz = rows[:, None] * 0
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            wm = n_mask[:, None] & k_mask[None, :]
            w = _load_w(w_ptr, s_ptr, mn_ptr, rows, offs_k, wm, K, n_groups, FMT, GROUP)
            wu = w
            if GLU:   # the up-projection rows N + n of the fused gate/up weight, loaded with the gate's
                wu = _load_w(w_ptr, s_ptr, mn_ptr, rows + N, offs_k, wm, K, n_groups, FMT, GROUP)
            x = tl.load(x_ptr + nz + offs_k[None, :], mask=wm, other=0.0).to(tl.float32)   # M == 1
            if NORM:
                nw = tl.load(nw_ptr + nz + offs_k[None, :], mask=wm, other=0.0).to(tl.float32)
                x = x * rstd[:, None] * nw
            acc2 += x * w
            if GLU:
                acc2_up += x * wu
        acc = tl.sum(acc2, axis=1)[None, :]
        acc_up = tl.sum(acc2_up, axis=1)[None, :]
    elif DOT:
        # 2-16 rows on tensor cores: the rows padded to BLOCK_M = 16 (the smallest `tl.dot` tile) times
        # the transposed weight chunk, float32 accumulation. (The broadcast product below holds a
        # [rows, BLOCK_N, BLOCK_K] float32 tile in registers and spills: measured on an H100, a batch-8
        # step of the graph path took 9x its batch-1 time.) The float32 activations (the residual stream,
        # normalised) go in as two 16-bit parts, hi + lo, each multiplied: 16-bit weights are exact as
        # stored, dequantized chunks are split likewise (lo x lo dropped), float32 weights (a float32
        # model) take float32 products. About 16 mantissa bits, at no cost that matters in a product
        # bound by reading the weights; a float32 dot would run on the FMA units (measured on an H100:
        # about 6x slower than the broadcast product).
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            x = _load_x(x_ptr, offs_m, m_mask, stride_x, offs_k, k_mask, nw_ptr, rstd, NORM)
            if FMT == 0:   # [BLOCK_K, BLOCK_N], K contiguous: the weights as stored
                wm_t = k_mask[:, None] & n_mask[None, :]
                wt = tl.load(w_ptr + rows[None, :] * K + offs_k[:, None], mask=wm_t, other=0.0)
                acc = _dot_x(x, wt, acc, DOT_F32)
                if GLU:
                    wut = tl.load(w_ptr + (rows + N)[None, :] * K + offs_k[:, None], mask=wm_t, other=0.0)
                    acc_up = _dot_x(x, wut, acc_up, DOT_F32)
            else:
                wm = n_mask[:, None] & k_mask[None, :]
                w = _load_w(w_ptr, s_ptr, mn_ptr, rows, offs_k, wm, K, n_groups, FMT, GROUP)
                acc = _dot_xw(x, tl.trans(w), acc, DOT_F32)
                if GLU:
                    wu = _load_w(w_ptr, s_ptr, mn_ptr, rows + N, offs_k, wm, K, n_groups, FMT, GROUP)
                    acc_up = _dot_xw(x, tl.trans(wu), acc_up, DOT_F32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            x = _load_x(x_ptr, offs_m, m_mask, stride_x, offs_k, k_mask, nw_ptr, rstd, NORM)
            wm = n_mask[:, None] & k_mask[None, :]
            w = _load_w(w_ptr, s_ptr, mn_ptr, rows, offs_k, wm, K, n_groups, FMT, GROUP)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
            if GLU:   # the up-projection rows N + n of the fused gate/up weight
                wu = _load_w(w_ptr, s_ptr, mn_ptr, rows + N, offs_k, wm, K, n_groups, FMT, GROUP)
                acc_up += tl.sum(x[:, None, :] * wu[None, :, :], axis=2)
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if GLU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        o_ptrs = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
        if ACCUMULATE:
            acc += tl.load(o_ptrs, mask=mn_mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mn_mask)
    else:   # partials [SPLIT_K, M, N] (and the up half at [SPLIT_K, M, N:2N] with GLU)
        width = N * (1 + GLU)
        base = part_ptr + (pid_k * M + offs_m[:, None]) * width + offs_n[None, :]
        tl.store(base, acc, mask=mn_mask)
        if GLU:
            tl.store(base + N, acc_up, mask=mn_mask)
        # the last of the tile's SPLIT_K programs to finish sums the partials (in split order, so the
        # result does not depend on which one that is) and writes the output: no second launch
        tl.debug_barrier()
        done = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            offs_s = tl.arange(0, SPLIT_PAD)
            s_mask = offs_s < SPLIT_K
            m3 = s_mask[:, None, None] & mn_mask[None, :, :]
            p3 = part_ptr + (offs_s[:, None, None] * M + offs_m[None, :, None]) * width + offs_n[None, None, :]
            y = tl.sum(tl.load(p3, mask=m3, other=0.0, cache_modifier=".cg"), axis=0)
            if GLU:
                u = tl.sum(tl.load(p3 + N, mask=m3, other=0.0, cache_modifier=".cg"), axis=0)
                y = y / (1.0 + tl.exp(-y)) * u
            o_ptrs = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
            if ACCUMULATE:
                y += tl.load(o_ptrs, mask=mn_mask, other=0.0).to(tl.float32)
            tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=mn_mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0)    # ready for the next launch (a CUDA-graph replay)


def _fmt_of(w: torch.Tensor, scale, mn) -> int:
    if scale is None:
        return DENSE
    if w.dtype == torch.int8:
        return INT8
    assert w.dtype == torch.uint8 and mn is not None, "int4 needs uint8 data and a min"
    return INT4


def matvec(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
           mn: torch.Tensor | None = None, out: torch.Tensor | None = None, accumulate: bool = False,
           group: int = 32, block_n: int = 32, block_k: int = 64, split_k: int = 1,
           workspace: torch.Tensor | None = None, num_warps: int = 4,
           norm_weight: torch.Tensor | None = None, eps: float = 1e-6, glu: bool = False,
           locks: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ out if accumulate). x [M, K]; see the module docstring for W's formats.
    Fusions: `norm_weight` applies RMSNorm to x first (y = rmsnorm(x) * norm_weight @ W^T, statistics
    in float32); `glu` treats W as fused gate/up rows [gate; up] (2N rows) and returns
    silu(x @ gate^T) * (x @ up^T), [M, N]."""
    assert x.dim() == 2 and x.stride(1) == 1
    M, K = x.shape
    fmt = _fmt_of(w, scale, mn)
    N = w.shape[0] // 2 if glu else w.shape[0]
    assert w.is_contiguous() and (not glu or w.shape[0] == 2 * N)
    if fmt == INT4:
        assert w.shape[1] * 2 == K and K % 32 == 0
        group, n_groups = 32, K // 32
    elif fmt == INT8:
        assert w.shape[1] == K
        scale = scale.reshape(w.shape[0], -1)
        n_groups = scale.shape[1]
        group = K if n_groups == 1 else group
        assert n_groups * group == K
    else:
        assert w.shape[1] == K
        n_groups = 1
    if out is None:
        assert not accumulate
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.stride(1) == 1
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    width = N * (2 if glu else 1)
    tiles = triton.cdiv(N, block_n)
    if split_k > 1:
        part = workspace if workspace is not None else torch.empty(
            (split_k, M, width), dtype=torch.float32, device=x.device)
        assert part.numel() >= split_k * M * width
        if locks is None:
            locks = torch.zeros(tiles, dtype=torch.int32, device=x.device)
        assert locks.dtype == torch.int32 and locks.numel() >= tiles
    else:
        part = out
    dummy = x
    # several rows with tiles `tl.dot` can take: tensor cores, the rows padded to 16
    dot = M >= 2 and block_n >= 16 and block_k >= 16 and M <= 16
    _matvec_kernel[(tiles, split_k)](
        x, w, scale if scale is not None else dummy, mn if mn is not None else dummy,
        norm_weight if norm_weight is not None else dummy, out, part, locks if locks is not None else dummy,
        M, N, K, x.stride(0), out.stride(0), k_per_split, n_groups, float(eps),
        FMT=fmt, GROUP=group, BLOCK_M=16 if dot else max(triton.next_power_of_2(M), 1), BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, ACCUMULATE=accumulate, NORM=norm_weight is not None, GLU=glu,
        SPLIT_PAD=max(triton.next_power_of_2(split_k), 2), DOT=dot,
        # Triton's interpreter (3.9) multiplies 16-bit `tl.dot` operands wrongly: widened there, after
        # the same rounding to 16 bits
        DOT_F32=x.device.type == "cpu", num_warps=num_warps)
    return out


def dequantize_ref(w: torch.Tensor, scale: torch.Tensor | None = None, mn: torch.Tensor | None = None,
                   group: int = 32) -> torch.Tensor:
    """float32 [N, K] weights from any of the formats (the same maths as `Linear.dequantize`)."""
    fmt = _fmt_of(w, scale, mn)
    N = w.shape[0]
    if fmt == DENSE:
        return w.float()
    if fmt == INT8:
        K = w.shape[1]
        s = scale.reshape(N, -1).float()
        gs = K // s.shape[1]
        return (w.view(N, -1, gs).float() * s[:, :, None]).view(N, K)
    K = w.shape[1] * 2
    p = w.view(N, K // 32, 16)
    q = torch.cat([p & 15, p >> 4], dim=-1).float()
    return (scale.view(N, -1, 1) * q + mn.view(N, -1, 1)).view(N, K)


def matvec_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
               mn: torch.Tensor | None = None, out: torch.Tensor | None = None,
               accumulate: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               glu: bool = False) -> torch.Tensor:
    xf = x.float()
    if norm_weight is not None:
        xf = torch.nn.functional.rms_norm(xf, (xf.shape[-1],), norm_weight.float(), eps)
    y = xf @ dequantize_ref(w, scale, mn).T
    if glu:
        n = y.shape[1] // 2
        y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
    if accumulate:
        y = y + out.float()
    return y.to(x.dtype)
