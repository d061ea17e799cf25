"""Token selection on the device, one program per row of logits [B, V].

greedy: argmax per row, the lowest index on ties (as `torch.argmax` on CPU).
sampled: softmax(logits / temperature) by inverse CDF with one given uniform u in [0, 1) per row:
the token is the first index i with cumsum(exp((x - max) / T))[i] > u * sum (the same rule as
`torch.searchsorted(cdf, u * cdf[-1], right=True)`). Top-k (optional) takes `torch.topk` on the
device first and samples among the k candidates in descending order. `select_tokens` mixes both:
rows with temperature <= 0 are greedy. No host synchronisation; all shapes are static.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        x = tl.load(x_ptr + row * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        mx = tl.max(x, axis=0)
        i = tl.min(tl.where(x == mx, idx, V), axis=0)
        take = (mx > best) & (i < V)
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, mx, best)
    tl.store(out_ptr + row, best_i.to(out_ptr.dtype.element_ty))


@triton.jit
def _sample_kernel(x_ptr, temp_ptr, u_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inv_t = 1.0 / tl.load(temp_ptr + row).to(tl.float32)
    u = tl.load(u_ptr + row).to(tl.float32)
    m = tl.full((), float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        x = tl.load(x_ptr + row * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, axis=0))
    z = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        x = tl.load(x_ptr + row * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        z += tl.sum(tl.where(idx < V, tl.exp((x - m) * inv_t), 0.0), axis=0)
    target = u * z
    run = tl.zeros((), tl.float32)
    found = tl.full((), V - 1, tl.int32)        # rounding fallback: the last token
    done = tl.zeros((), tl.int32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        valid = idx < V
        x = tl.load(x_ptr + row * stride_x + idx, mask=valid, other=float("-inf")).to(tl.float32)
        e = tl.where(valid, tl.exp((x - m) * inv_t), 0.0)
        c = run + tl.cumsum(e, axis=0)
        cand = tl.min(tl.where((c > target) & valid & (e > 0), idx, V), axis=0)
        hit = (done == 0) & (cand < V)
        found = tl.where(hit, cand, found)
        done = tl.where(hit, 1, done)
        run += tl.sum(e, axis=0)
    tl.store(out_ptr + row, found.to(out_ptr.dtype.element_ty))


def _block(V: int, block: int) -> int:
    return min(block, triton.next_power_of_2(V))


def greedy(logits: torch.Tensor, out: torch.Tensor | None = None, block: int = 4096) -> torch.Tensor:
    """logits [B, V] -> int64 [B]."""
    assert logits.stride(1) == 1
    B, V = logits.shape
    o = torch.empty(B, dtype=torch.int64, device=logits.device) if out is None else out
    _argmax_kernel[(B,)](logits, o, V, logits.stride(0), BLOCK=_block(V, block))
    return o


def sample(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor,
           top_k: int | None = None, out: torch.Tensor | None = None, block: int = 4096) -> torch.Tensor:
    """logits [B, V], temperature [B] (> 0), uniform [B] in [0, 1) -> int64 [B]."""
    B, V = logits.shape
    o = torch.empty(B, dtype=torch.int64, device=logits.device) if out is None else out
    cand = None
    if top_k is not None and 0 < top_k < V:
        logits, cand = torch.topk(logits, top_k, dim=-1)   # sorted, descending
        V = top_k
    assert logits.stride(1) == 1
    _sample_kernel[(B,)](logits, temperature, uniform, o, V, logits.stride(0), BLOCK=_block(V, block))
    if cand is not None:
        o.copy_(cand.gather(1, o[:, None])[:, 0])
    return o


def select_tokens(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor,
                  top_k: int | None = None) -> torch.Tensor:
    """Greedy where temperature <= 0, sampled elsewhere; int64 [B]."""
    g = greedy(logits)
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    s = sample(logits, safe_t, uniform, top_k)
    return torch.where(temperature > 0, s, g)


def greedy_ref(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    mx = x.max(dim=-1, keepdim=True).values
    idx = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(x == mx, idx, x.shape[-1]).min(dim=-1).values


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor,
               top_k: int | None = None) -> torch.Tensor:
    x = logits.float()
    cand = None
    if top_k is not None and 0 < top_k < x.shape[-1]:
        x, cand = torch.topk(x, top_k, dim=-1)
    e = torch.exp((x - x.max(dim=-1, keepdim=True).values) / temperature.float()[:, None])
    cdf = e.cumsum(dim=-1)
    target = (uniform.float() * cdf[:, -1])[:, None]
    i = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_max(x.shape[-1] - 1)
    return i if cand is None else cand.gather(1, i[:, None])[:, 0]
