"""The Llama-family decode step over the Triton kernels (`kernels/triton/`).

One call per operator over the whole batch: residual-add RMSNorm, fused QKV matvec (bf16/fp32,
int8 or int4 weights as they are packed), RoPE + paged KV append, split-K paged attention, output
matvec accumulated into the residual, RMSNorm, gate/up matvec, SwiGLU, down matvec accumulated,
final norm and LM head. This is the step the CUDA-graph runtime captures on a GPU (static
buffers, one graph per batch bucket); on a CPU it runs under Triton's interpreter, which is how it
is checked against the eager step (`tests/runtime/test_triton_step.py`).
"""
from __future__ import annotations

import torch

from slipstream.kv.blocks import PagedKVCache
from slipstream.models.llama import LlamaModel, StepInput
from slipstream.weights.quant import Q8_0, Linear


def _weight_args(w: Linear) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The matvec kernel's view of a weight: dense, int8 + scales, or int4 nibbles + scales and mins."""
    if not w.packed:
        return w.data, None, None
    if w.fmt == Q8_0:
        return w.data, w.scale, None
    return w.data, w.scale, w.min


class TritonDecoder:
    """Decode steps (one new token per sequence) of a Llama-family model with the Triton kernels."""

    def __init__(self, model: LlamaModel, kv: PagedKVCache):
        c = model.cfg
        if c.head_dim & (c.head_dim - 1):
            raise ValueError("the Triton decode step needs a power-of-two head_dim")
        if c.head_dim != 2 * model.inv_freq.numel():
            raise ValueError("the Triton decode step rotates the whole head (no partial rotary)")
        self.model, self.kv = model, kv
        self.layers = [{k: _weight_args(L[k]) for k in ("qkv", "o", "gate_up", "down")} for L in model.layers]
        self.lm_head = _weight_args(model.lm_head)

    def _block_tables(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.kv.block_size
        tables = []
        for s in step.seqs:
            slots = torch.arange(s.read[0], s.read[1]) if isinstance(s.read, tuple) else s.read
            tables.append(slots[::bs] // bs)
        width = max(t.numel() for t in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int64)
        for i, t in enumerate(tables):
            bt[i, :t.numel()] = t
        return bt, torch.tensor([s.context for s in step.seqs], dtype=torch.int32)

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        from slipstream.kernels.triton.attention import paged_decode_attention
        from slipstream.kernels.triton.matvec import matvec
        from slipstream.kernels.triton.norm import add_rmsnorm
        from slipstream.kernels.triton.rope import rope_kv_append
        from slipstream.kernels.triton.swiglu import swiglu

        m, c = self.model, self.model.cfg
        if any(s.length != 1 for s in step.seqs):
            raise ValueError("the Triton step decodes one token per sequence")
        H, KVH, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        B = step.token_ids.shape[0]
        x = m.embed.dequantize(step.token_ids).contiguous()
        bt, ctx = self._block_tables(step)
        max_ctx = int(ctx.max())
        for li, (L, W) in enumerate(zip(m.layers, self.layers)):
            _, h = add_rmsnorm(x, None, L["attn_norm"], eps)
            qkv = matvec(h, *W["qkv"])
            if L["qkv"].bias is not None:
                qkv += L["qkv"].bias
            q = rope_kv_append(qkv, step.positions, m.inv_freq, step.write_slots, self.kv.k[li], self.kv.v[li],
                               H, KVH, D, q_norm=L["q_norm"], k_norm=L["k_norm"], eps=eps)
            attn = paged_decode_attention(q, self.kv.k[li], self.kv.v[li], bt, ctx, max_ctx,
                                          block_size=self.kv.block_size)
            matvec(attn.reshape(B, H * D), *W["o"], out=x, accumulate=True)
            _, h = add_rmsnorm(x, None, L["ffn_norm"], eps)
            act = swiglu(matvec(h, *W["gate_up"]))
            matvec(act, *W["down"], out=x, accumulate=True)
        _, h = add_rmsnorm(x, None, m.norm, eps)
        rows = step.logits_rows
        h = h if rows.numel() == B else h.index_select(0, rows).contiguous()
        return matvec(h, *self.lm_head)
