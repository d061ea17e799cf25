"""MoE decode: per-(token, expert-slot) grouped matrix-vector with SwiGLU, float and int8 weights.

Maths (same as `DeepseekModel._moe` for the routed experts, shared experts excluded):

    out[t] = sum_j  w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),   e = ids[t, j]

with `gate_up[e]` = [gate; up] stacked as [2F, D] (rows :F gate, F: up) and `down[e]` [D, F], the
layout `deepseek.py` uses (`W["gate_up"]` [E, 2F, D], `W["down"]` [E, D, F]).

Design (two launches, no atomics, deterministic):
  1. `_moe_gate_up_kernel`, grid (T*k, cdiv(F, BLOCK_F)): each program owns one routed pair
     (token t, slot j) and a tile of F rows; it streams the matching gate and up rows of expert
     ids[t, j] over D in BLOCK_D chunks, and writes h = silu(g) * u (fp32) into a [T*k, F] buffer.
  2. `_moe_down_kernel`, grid (T, cdiv(D, BLOCK_N)): each program owns a tile of output rows of one
     token and loops over its k slots (and over F in chunks), accumulating w * down[e] @ h in fp32,
     so the sum over experts happens in registers and the output is written once.
Every weight byte of an active (token, expert) pair is read once per token: at decode (T <= 8)
this is the bandwidth floor when the routed experts of the batch are distinct; when tokens share
an expert its rows are read once per token (L2 usually absorbs the repeats). A grouped-by-expert
variant (sorted pairs, one program per expert tile with a BLOCK_T token dimension and tl.dot) is the
next step for larger batches.

int8 weight-only variant: weights int8 with float32 scales [E, N, K // group] (the
`weights/quant.py` Q8 convention: w = scale * q, one scale per `group` consecutive inputs of a
row; group = K is per-row). The scale is applied to the dequantised tile before the multiply-add.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - references stay usable without triton
    triton = None


# -- references ----------------------------------------------------------------------------------
def moe_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """The eager maths of `DeepseekModel._moe` (routed part), in fp32. [T, D]."""
    x = x.float()
    out = torch.zeros_like(x)
    f = gate_up.shape[1] // 2
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        gu = F.linear(x.index_select(0, rows), gate_up[e].float())
        y = F.linear(F.silu(gu[:, :f]) * gu[:, f:], down[e].float())
        out[rows] += y * weights[rows, slot, None].float()
    return out


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [E, N, K] with scales [E, N, K // group] -> float32 [E, N, K]."""
    E, N, K = q.shape
    g = K // scale.shape[-1]
    return (q.float().view(E, N, K // g, g) * scale.float().unsqueeze(-1)).view(E, N, K)


def quantize_int8(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one float32 scale per `group` inputs of a row (None: per row)."""
    E, N, K = w.shape
    g = K if group is None else group
    assert K % g == 0
    wg = w.float().view(E, N, K // g, g)
    scale = wg.abs().amax(-1).clamp_min(1e-12) / 127.0
    q = torch.round(wg / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.view(E, N, K), scale.contiguous()


def moe_int8_reference(x, ids, weights, gate_up_q, gate_up_scale, down_q, down_scale):
    return moe_reference(x, ids, weights, dequantize_int8(gate_up_q, gate_up_scale),
                         dequantize_int8(down_q, down_scale))


# -- kernels -------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _moe_gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, h_ptr,
                            K, D, Fdim, NG,
                            QUANT: tl.constexpr, GROUP: tl.constexpr,
                            BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
        pair = tl.program_id(0)            # t * K + j
        fb = tl.program_id(1)
        t = pair // K
        e = tl.load(ids_ptr + pair).to(tl.int64)
        offs_f = fb * BLOCK_F + tl.arange(0, BLOCK_F)
        mask_f = offs_f < Fdim
        rows_g = e * 2 * Fdim + offs_f     # gate rows; up rows are + Fdim
        rows_u = rows_g + Fdim
        acc_g = tl.zeros([BLOCK_F], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_F], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            xv = tl.load(x_ptr + t * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            m2 = mask_f[:, None] & mask_d[None, :]
            wg = tl.load(w_ptr + rows_g[:, None] * D + offs_d[None, :], mask=m2, other=0)
            wu = tl.load(w_ptr + rows_u[:, None] * D + offs_d[None, :], mask=m2, other=0)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
            if QUANT:
                gi = offs_d[None, :] // GROUP
                wg = wg * tl.load(s_ptr + rows_g[:, None] * NG + gi, mask=m2, other=0.0)
                wu = wu * tl.load(s_ptr + rows_u[:, None] * NG + gi, mask=m2, other=0.0)
            acc_g += tl.sum(wg * xv[None, :], axis=1)
            acc_u += tl.sum(wu * xv[None, :], axis=1)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + pair * Fdim + offs_f, h, mask=mask_f)

    @triton.jit
    def _moe_down_kernel(h_ptr, ids_ptr, wt_ptr, w_ptr, s_ptr, out_ptr,
                         K, D, Fdim, NG,
                         QUANT: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < D
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(0, K):
            pair = t * K + j
            e = tl.load(ids_ptr + pair).to(tl.int64)
            wt = tl.load(wt_ptr + pair).to(tl.float32)
            rows = e * D + offs_n
            part = tl.zeros([BLOCK_N], dtype=tl.float32)
            for f0 in range(0, Fdim, BLOCK_F):
                offs_f = f0 + tl.arange(0, BLOCK_F)
                mask_f = offs_f < Fdim
                hv = tl.load(h_ptr + pair * Fdim + offs_f, mask=mask_f, other=0.0)
                m2 = mask_n[:, None] & mask_f[None, :]
                wv = tl.load(w_ptr + rows[:, None] * Fdim + offs_f[None, :], mask=m2, other=0)
                wv = wv.to(tl.float32)
                if QUANT:
                    sc = tl.load(s_ptr + rows[:, None] * NG + offs_f[None, :] // GROUP, mask=m2,
                                 other=0.0)
                    wv = wv * sc
                part += tl.sum(wv * hv[None, :], axis=1)
            acc += wt * part
        tl.store(out_ptr + t * D + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _launch(x, ids, weights, gate_up, down, gu_scale, dn_scale, block_f=None, block_d=None):
    assert triton is not None, "triton is not installed"
    T, D = x.shape
    E, F2, D2 = gate_up.shape
    Fdim = F2 // 2
    assert D2 == D and down.shape == (E, D, Fdim) and ids.shape == weights.shape
    K = ids.shape[1]
    quant = gu_scale is not None
    x = x.contiguous()
    ids = ids.to(torch.int32).contiguous()
    weights = weights.to(torch.float32).contiguous()
    h = torch.empty((T * K, Fdim), dtype=torch.float32, device=x.device)
    out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    BF = block_f or min(64, triton.next_power_of_2(Fdim))
    BD = block_d or min(128, triton.next_power_of_2(D))
    ng1 = gu_scale.shape[-1] if quant else 1
    ng2 = dn_scale.shape[-1] if quant else 1
    dummy = h
    _moe_gate_up_kernel[(T * K, triton.cdiv(Fdim, BF))](
        x, ids, gate_up, gu_scale if quant else dummy, h, K, D, Fdim, ng1,
        QUANT=quant, GROUP=D // ng1, BLOCK_F=BF, BLOCK_D=BD)
    BN = block_d or min(64, triton.next_power_of_2(D))
    BF2 = block_f or min(128, triton.next_power_of_2(Fdim))
    _moe_down_kernel[(T, triton.cdiv(D, BN))](
        h, ids, weights, down, dn_scale if quant else dummy, out, K, D, Fdim, ng2,
        QUANT=quant, GROUP=Fdim // ng2, BLOCK_N=BN, BLOCK_F=BF2)
    return out


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, **blocks) -> torch.Tensor:
    """Routed-expert output [T, D] (dtype of x) for float (fp32/bf16/fp16) stacked weights."""
    return _launch(x, ids, weights, gate_up.contiguous(), down.contiguous(), None, None, **blocks)


def moe_decode_int8(x, ids, weights, gate_up_q, gate_up_scale, down_q, down_scale, **blocks):
    """As `moe_decode` with int8 weights and float32 scales [E, N, K // group] (group divides K)."""
    return _launch(x, ids, weights, gate_up_q.contiguous(), down_q.contiguous(),
                   gate_up_scale.float().contiguous(), down_scale.float().contiguous(), **blocks)
