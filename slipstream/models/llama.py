"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, Gemma 2/3, Phi-3) in plain torch over a
paged KV cache.

One forward call runs a *step*: the new tokens of one or more sequences, flattened into a single
[T] batch (a whole prompt for prefill, one token per sequence for decode). Dense work (norms,
projections, MLP) runs on the whole batch; attention runs per sequence against its cache slots.
Weights are `Linear`s, packed or dense, with Q/K/V and gate/up fused into one product each.

`DecoderModel` is the step with every feature of the family (Gemma's soft-capping, post-norms, GeGLU,
scaled embedding and sliding windows; Phi-3's LongRoPE and partial rotary); `LlamaModel` is the dense
family (each runtime refuses the features it does not compute: `runtime.registry.unsupported`);
`models.qwen_moe.QwenMoeModel` replaces the MLP with experts.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.kv.blocks import HybridKVCache, PagedKVCache, read_rows
from slipstream.step import SeqSlice, StepInput
from slipstream.weights.layers import LlamaLayer
from slipstream.weights.quant import Linear, matvec_only, rows_invariant

def glu(gu: torch.Tensor, f: int, gelu: bool = False) -> torch.Tensor:
    """act(gu[:, :f]) * gu[:, f:] (SiLU, or GELU's tanh form) for gu [T, 2f]. On the exact path's eager step by
    the native kernels, row by row: torch splits an elementwise op among its threads (GELU from ~16K elements,
    SiLU from 32K) at points inside rows, whose ends then take its scalar tail, which rounds differently from
    its vector loop, so a row's result changed with the number of rows beside it (seen with 8 threads)."""
    if rows_invariant() and gu.dtype == torch.float32 and gu.device.type == "cpu" and gu.dim() == 2:
        from slipstream.kernels.cpu import load_library
        lib = load_library()
        if lib is not None:
            src = gu.contiguous()
            out = torch.empty(src.shape[0], f, dtype=torch.float32)
            (lib.gelu_tanh_mul if gelu else lib.silu_mul)(src.data_ptr(), src.shape[0], f, out.data_ptr())
            return out
    gate = F.gelu(gu[:, :f], approximate="tanh") if gelu else F.silu(gu[:, :f])
    return gate * gu[:, f:]


def rope_inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    dim = cfg.rope_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if freq_factors is not None:
        return inv / freq_factors
    rs = cfg.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor = float(rs["factor"])
        lo, hi = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    if kind == "longrope":   # the short factors; `LongRope` picks the long ones for long sequences
        return inv / torch.tensor(rs["short_factor"], dtype=torch.float32)
    if kind == "default":
        return inv
    raise ModelLoadError(f"unsupported rope scaling {kind!r} for the Llama family")


class LongRope:
    """LongRoPE (Phi-3/3.5/4): inverse frequencies divided by the short factors while a sequence is
    at most `original_max_position_embeddings` long, by the long factors once it is longer (as
    transformers picks them: by the sequence length the step reaches, for all of that step's tokens);
    cos and sin scaled by the attention factor sqrt(1 + ln(s) / ln(original)), s = the context
    extension, unless the config gives `attention_factor`."""

    def __init__(self, cfg: ModelConfig):
        rs = cfg.rope_scaling or {}
        dim = cfg.rope_dim
        base = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.original = int(rs["original_max_position_embeddings"])
        self.short = base / torch.tensor(rs["short_factor"], dtype=torch.float32)
        self.long = base / torch.tensor(rs["long_factor"], dtype=torch.float32)
        factor = rs.get("factor") or cfg.max_position_embeddings / self.original
        amp = rs.get("attention_factor")
        if amp is None:
            amp = math.sqrt(1 + math.log(factor) / math.log(self.original)) if factor > 1.0 else 1.0
        self.amp = float(amp)

    def to(self, device: torch.device | str) -> LongRope:
        self.short, self.long = self.short.to(device), self.long.to(device)
        return self

    def tables(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary dim] of the step's rows, each row with its sequence's factors."""
        long_rows = torch.zeros(step.token_ids.shape[0], dtype=torch.bool)
        for s in step.seqs:
            if s.context > self.original:
                long_rows[s.start:s.start + s.length] = True
        inv = torch.where(long_rows.to(self.short.device)[:, None], self.long[None, :], self.short[None, :])
        freqs = step.positions.to(torch.float32)[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.amp)[:, None, :], (emb.sin() * self.amp)[:, None, :]


class DecoderModel:
    """The decoder step shared by the Llama family and the Qwen MoE family: embedding, attention
    layers over the paged cache (GQA, RoPE, optional biases, q/k norms, Gemma's extras), an FFN per
    layer (`_ffn`, dense here), the final norm and LM head."""
    devices = ("cpu", "cuda")

    def __init__(self, cfg: ModelConfig, weights: dict[str, Any]):
        self.cfg = cfg
        self.embed: Linear = weights["embed"]
        self.lm_head: Linear = weights["lm_head"]
        self.norm: torch.Tensor = weights["norm"]
        self.layers: list[LlamaLayer] = [weights[f"layers.{i}"] for i in range(cfg.num_layers)]
        inv = weights.get("inv_freq")
        self.inv_freq = inv if inv is not None else rope_inv_freq(cfg, weights.get("rope_freqs"))
        # Gemma 3's sliding-window layers rotate with their own base (and no scaling)
        self.inv_freq_local = None if cfg.rope_local_theta is None else rope_inv_freq(
            dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None))
        kind = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type"))
        self.longrope = LongRope(cfg) if kind == "longrope" else None
        self.device = self.embed.data.device
        self.kv_dtype = torch.float32   # the cache's element type: the weights' on a GPU

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> DecoderModel:
        """Moves the weights to `device` (dense ones cast to `dtype`; norms and RoPE stay float32) and
        makes new KV caches there in `dtype`. The residual stream and norms compute in float32."""
        moved: dict[int, Linear] = {}   # keeps tied embeddings tied

        def lin(w: Linear) -> Linear:
            if id(w) not in moved:
                moved[id(w)] = w.to(device, dtype)
            return moved[id(w)]

        def vec(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=torch.float32)
        self.embed, self.lm_head, self.norm = lin(self.embed), lin(self.lm_head), vec(self.norm)
        self.layers = [L.map(lin, vec) for L in self.layers]
        self.inv_freq = self.inv_freq.to(device)
        if self.inv_freq_local is not None:
            self.inv_freq_local = self.inv_freq_local.to(device)
        if self.longrope is not None:
            self.longrope.to(device)
        self.device = torch.device(device)
        self.kv_dtype = dtype
        return self

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes one token takes in a cache of `dtype` elements (default: `kv_dtype`; int8: a float32
        scale per row beside the codes)."""
        c = self.cfg
        dt = dtype or self.kv_dtype
        row = c.head_dim + 4 if dt == torch.int8 else c.head_dim * dt.itemsize
        return 2 * c.num_layers * c.num_kv_heads * row

    def new_kv_cache(self, num_blocks: int, block_size: int = 16, dtype: torch.dtype | None = None) -> PagedKVCache:
        """A paged cache on the model's device, of `dtype` elements (default: `kv_dtype`; on the CPU fp16
        halves its bytes: the step reads and writes it in fp32, converting on the way)."""
        c = self.cfg
        sliding = [c.is_sliding(i) for i in range(c.num_layers)]
        if c.sliding_window and any(sliding) and not all(sliding):   # Gemma 2/3: the sliding layers keep their window
            return HybridKVCache(sliding, c.sliding_window, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                                 dtype=dtype or self.kv_dtype, device=self.device)
        kv = PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                          dtype=dtype or self.kv_dtype, device=self.device)
        kv.window = c.window_everywhere   # every layer slides: blocks out of the window go back
        return kv

    def _rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq if inv_freq is None else inv_freq
        freqs = positions.to(torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = cos.shape[-1]
        if rd != x.shape[-1]:   # partial rotary: the leading rd dims rotate, the rest pass through
            return torch.cat((DecoderModel._rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _attention(self, q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor,
                   s: SeqSlice, scale: float | None = None, window: int | None = None,
                   softcap: float | None = None,
                   scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> torch.Tensor:
        """q [len, H, D] against the sequence's cached keys -> [len, H, D]; with `window`, a query
        sees only the keys less than `window` positions behind it (sliding-window layers); with
        `softcap`, scores become softcap * tanh(scores / softcap) before the mask (Gemma 2).
        `scales`: an int8 cache's K and V scale planes (its rows then read as codes x scales)."""
        k, v = read_rows(layer_k, scales[0], s.read), read_rows(layer_v, scales[1], s.read)
        out_dtype = q.dtype
        if q.is_cuda:   # attention in the cache's dtype: bf16 reaches the fused SDPA kernels
            q = q.to(k.dtype)
        else:
            k, v = k.to(q.dtype), v.to(q.dtype)
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        mask = None
        causal = False
        if window is not None and s.context > window:
            qpos = s.context - s.length + torch.arange(s.length, device=q.device)[:, None]
            j = torch.arange(s.context, device=q.device)[None, :]
            mask = (j <= qpos) & (qpos - j < window)
        elif s.length > 1:
            if s.length == s.context:
                causal = True
            else:  # chunk after cached tokens: query i sees keys up to context - length + i
                i = torch.arange(s.length, device=q.device)[:, None]
                j = torch.arange(s.context, device=q.device)[None, :]
                mask = j <= (s.context - s.length + i)
        if softcap is not None:
            return self._softcapped(qh, kh, vh, mask, causal, scale, softcap).transpose(0, 1).to(out_dtype)
        # with a batch dimension: torch's CPU flash kernel takes only 4-D inputs; 3-D ones go to the
        # unfused path (measured on the 2-core CPU: 512-token causal prefill, 9 heads over 3, 24.6 -> 6.1 ms)
        out = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=mask, is_causal=causal,
                                             scale=scale, enable_gqa=kh.shape[0] != qh.shape[0])[0]
        return out.transpose(0, 1).to(out_dtype)

    @staticmethod
    def _softcapped(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, mask: torch.Tensor | None,
                    causal: bool, scale: float | None, cap: float) -> torch.Tensor:
        """Attention with tanh soft-capped scores, [H, len, D] (SDPA has no soft-capping)."""
        if kh.shape[0] != qh.shape[0]:
            rep = qh.shape[0] // kh.shape[0]
            kh, vh = kh.repeat_interleave(rep, dim=0), vh.repeat_interleave(rep, dim=0)
        scores = torch.matmul(qh, kh.transpose(1, 2)) * (qh.shape[-1] ** -0.5 if scale is None else scale)
        scores = torch.tanh(scores / cap) * cap
        if causal:
            n = qh.shape[1]
            mask = torch.ones(n, kh.shape[1], dtype=torch.bool, device=qh.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(vh.dtype), vh)

    def _ffn(self, li: int, L: Any, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Layer li's MLP on the normed h, added to the residual stream x (returned)."""
        c = self.cfg
        gu = L.gate_up(h)
        f = c.intermediate_size
        act = glu(gu, f, c.hidden_act == "gelu_tanh")
        if L.post_ffn_norm is None:
            L.down(act, out=x, accumulate=True)
            return x
        return x + F.rms_norm(L.down(act), (c.hidden_size,), L.post_ffn_norm, c.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, step: StepInput, kv: PagedKVCache, return_hidden: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [len(logits_rows), vocab]; with return_hidden also the final-normed hidden state of
        every row [T, hidden]."""
        c = self.cfg
        T = step.token_ids.shape[0]
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        qd, kd = H * D, KVH * D
        eps = c.rms_norm_eps
        if self.device.type != "cpu":
            step = step.to(self.device)
        x = self.embed.dequantize(step.token_ids).to(torch.float32)
        if c.embed_scale is not None:
            x = x * torch.tensor(c.embed_scale, dtype=torch.float32)
        rope_full = self._rope_tables(step.positions) if self.longrope is None else self.longrope.tables(step)
        rope_local = None if self.inv_freq_local is None else self._rope_tables(step.positions, self.inv_freq_local)
        local_step = _local_step(step, kv) if isinstance(kv, HybridKVCache) else None
        for li, L in enumerate(self.layers):
            sliding = c.is_sliding(li)
            cos, sin = rope_local if sliding and rope_local is not None else rope_full
            window = c.sliding_window if sliding else None
            h = F.rms_norm(x, (c.hidden_size,), L.attn_norm, eps)
            qkv = L.qkv(h)
            q = qkv[:, :qd].view(T, H, D)
            k = qkv[:, qd:qd + kd].view(T, KVH, D)
            v = qkv[:, qd + kd:].view(T, KVH, D)
            if L.q_norm is not None:
                q = F.rms_norm(q, (D,), L.q_norm, eps)
                k = F.rms_norm(k, (D,), L.k_norm, eps)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            lk, lv, local = kv.layer_cache(li)   # Gemma's hybrid cache: the sliding layers address their own parts
            at = local_step if local and local_step is not None else step
            kv.store(li, at.write_slots, k, v)   # rounded to the cache's type (int8: codes and scales)
            scales = kv.layer_scales(li)
            cap = c.attn_softcap
            if len(at.seqs) == 1:
                attn = self._attention(q, lk, lv, at.seqs[0], c.attn_scale, window, cap, scales)
            else:
                attn = torch.cat([self._attention(q[s.start:s.start + s.length], lk, lv, s, c.attn_scale,
                                                  window, cap, scales) for s in at.seqs])
            if L.post_attn_norm is None:
                L.o(attn.reshape(T, qd), out=x, accumulate=True)
            else:   # Gemma: the attention output is normalized before the residual add
                x = x + F.rms_norm(L.o(attn.reshape(T, qd)), (c.hidden_size,), L.post_attn_norm, eps)
            h = F.rms_norm(x, (c.hidden_size,), L.ffn_norm, eps)
            x = self._ffn(li, L, h, x)
        if return_hidden:
            h = F.rms_norm(x, (c.hidden_size,), self.norm, eps)
            last = h.index_select(0, step.logits_rows)
        else:
            last = F.rms_norm(x.index_select(0, step.logits_rows), (c.hidden_size,), self.norm, eps)
        with matvec_only():   # a sequence's logits must not depend on how many share the step
            logits = self.lm_head(last)
        if c.final_softcap is not None:   # Gemma 2
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return (logits, h) if return_hidden else logits


def _local_step(step: StepInput, kv: HybridKVCache) -> StepInput:
    """The step as a hybrid cache's sliding layers see it: write slots and reads translated to their parts."""
    dev = step.write_slots.device
    seqs = [dataclasses.replace(s, read=kv.local_slots(s.read if isinstance(s.read, tuple) else s.read.cpu()).to(dev))
            for s in step.seqs]
    return dataclasses.replace(step, write_slots=kv.local_slots(step.write_slots.cpu()).to(dev), seqs=seqs)


class LlamaModel(DecoderModel):
    """Llama 2/3, Mistral, Qwen2/3, SmolLM2, Phi-3/3.5/4-mini, Gemma 2/3: the dense Llama family. The
    native CPU step computes every feature of it; the GPU runtimes and tensor parallelism refuse the
    ones a plain Llama step lacks (`cfg.eager_only()` names them)."""

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> LlamaModel:
        super().to(device, dtype)
        return self
