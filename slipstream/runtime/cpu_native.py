"""The CPU decode step as a short list of native calls over static buffers.

Decode at batch 1..8 on a CPU is bound by per-operator overhead as much as by the weights' bytes:
the eager torch step issues ~20 torch ops per layer. Here each layer is nine calls into the C
kernels (RMSNorm, fused QKV product, RoPE + KV store, attention, output product + residual, RMSNorm,
gate/up product, SiLU*mul, down product + residual) on buffers allocated once per batch size,
the CPU counterpart of a captured CUDA graph. Prefill and anything unusual stay on the eager path
(`LlamaModel.forward`), which is also the reference this runner is tested against.
"""
from __future__ import annotations

import ctypes
from typing import Any, ClassVar

import torch

from slipstream.kernels.cpu import load_library
from slipstream.kv.blocks import PagedKVCache
from slipstream.models.llama import LlamaModel
from slipstream.step import StepInput
from slipstream.weights.layers import LlamaLayer


class _Buffers:
    def __init__(self, model: LlamaModel, batch: int):
        c = model.cfg
        qkv_dim = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        f32: dict[str, Any] = dict(dtype=torch.float32)
        self.x = torch.empty(batch, c.hidden_size, **f32)
        self.h = torch.empty(batch, c.hidden_size, **f32)
        self.qkv = torch.empty(batch, qkv_dim, **f32)
        self.attn = torch.empty(batch, c.num_heads * c.head_dim, **f32)
        self.gu = torch.empty(batch, 2 * c.intermediate_size, **f32)
        self.act = torch.empty(batch, c.intermediate_size, **f32)
        self.logits = torch.empty(batch, c.vocab_size, **f32)
        kmax = max(c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim)
        self.scratch = torch.empty(batch * (kmax // 32 + 1), **f32)


class NativeDecoder:
    """Runs decode steps (one new token per sequence) of a Llama-family model with native kernels."""

    name: ClassVar[str] = "native"
    device_greedy: ClassVar[bool] = False

    def __init__(self, model: LlamaModel, kv: PagedKVCache, exact: bool = False):
        # `exact` (fp32-activation kernels) is the only mode these kernels have: accepted, nothing to switch
        lib = load_library()
        if lib is None:
            raise RuntimeError("native CPU kernels are not available on this machine")
        self.lib = lib
        self.model = model
        self.kv = kv
        self._buffers: dict[int, _Buffers] = {}
        c = model.cfg
        self._layers = [self._layer_args(L) for L in model.layers]
        self._kv_ptrs = [(kv.k[i].data_ptr(), kv.v[i].data_ptr()) for i in range(c.num_layers)]

    @classmethod
    def unsupported(cls, model) -> str | None:
        if not isinstance(model, LlamaModel):
            return f"the native runtime needs a Llama-family model, got {type(model).__name__}"
        mats = [m for L in model.layers for m in L.linears()] + [model.lm_head]
        if not all(m.packed for m in mats) or any(L.qkv.bias is not None for L in model.layers):
            return "the native runtime needs packed GGUF weights (Q4_0/Q4_1/Q8_0/Q4_K) without q/k/v biases"
        if load_library() is None:
            return "the native CPU kernels are not available on this machine"
        return None

    def _layer_args(self, L: LlamaLayer) -> dict:
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        return {"attn_norm": ptr(L.attn_norm), "ffn_norm": ptr(L.ffn_norm),
                "q_norm": ptr(L.q_norm), "k_norm": ptr(L.k_norm),
                "qkv": L.qkv, "o": L.o, "gate_up": L.gate_up, "down": L.down}

    def _buf(self, batch: int) -> _Buffers:
        if batch not in self._buffers:
            self._buffers[batch] = _Buffers(self.model, batch)
        return self._buffers[batch]

    def _matvec(self, w, x: torch.Tensor, out: torch.Tensor, rows: int, accumulate: bool,
                scratch: torch.Tensor) -> None:
        w.native(self.lib, x.data_ptr(), rows, out.data_ptr(), accumulate, scratch.data_ptr())

    @torch.inference_mode()
    def forward(self, step: StepInput, tokens_only: bool = False) -> torch.Tensor:
        if tokens_only:
            raise ValueError("the native runtime returns logits (device_greedy is False)")
        m, c, lib = self.model, self.model.cfg, self.lib
        B = step.token_ids.shape[0]
        b = self._buf(B)
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        eps, hid, F = c.rms_norm_eps, c.hidden_size, c.intermediate_size
        # per-step inputs: embeddings, rotary tables, the context slots of every sequence
        b.x[:B].copy_(m.embed.dequantize(step.token_ids))
        freqs = step.positions.to(torch.float32)[:, None] * m.inv_freq[None, :]
        cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
        parts = [torch.arange(s.read[0], s.read[1]) if isinstance(s.read, tuple) else s.read for s in step.seqs]
        slots = torch.cat(parts) if len(parts) > 1 else parts[0]
        starts = torch.zeros(B + 1, dtype=torch.long)
        starts[1:] = torch.tensor([s.context for s in step.seqs]).cumsum(0)
        write = step.write_slots.contiguous()
        x, h, qkv, attn, gu, act, scr = b.x, b.h, b.qkv, b.attn, b.gu, b.act, b.scratch
        xp, hp, qkvp, attnp, gup, actp = (t.data_ptr() for t in (x, h, qkv, attn, gu, act))
        csp, snp, slp, stp, wp = cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), starts.data_ptr(), write.data_ptr()
        scale = ctypes.c_float(D ** -0.5)
        feps = ctypes.c_float(eps)
        for L, (kp, vp) in zip(self._layers, self._kv_ptrs):
            lib.rmsnorm(xp, L["attn_norm"], B, hid, feps, hp)
            self._matvec(L["qkv"], h, qkv, B, False, scr)
            lib.rope_store(qkvp, B, H, KVH, D, csp, snp, L["q_norm"], L["k_norm"], feps, wp, kp, vp)
            lib.attn_decode(qkvp, (H + 2 * KVH) * D, B, H, KVH, D, slp, stp, kp, vp, scale, attnp)
            self._matvec(L["o"], attn, x, B, True, scr)
            lib.rmsnorm(xp, L["ffn_norm"], B, hid, feps, hp)
            self._matvec(L["gate_up"], h, gu, B, False, scr)
            lib.silu_mul(gup, B, F, actp)
            self._matvec(L["down"], act, x, B, True, scr)
        rows = step.logits_rows
        lib.rmsnorm(xp, m.norm.data_ptr(), B, hid, feps, hp)
        self._matvec(m.lm_head, h, b.logits, B, False, scr)
        return b.logits[rows].clone() if rows.numel() != B else b.logits[:B].clone()
