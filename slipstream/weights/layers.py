"""Typed per-layer weights: what the loaders write and every model and runtime reads.

A Llama-family layer holds its Q/K/V and gate/up products fused into one `Linear` each (the loaders
fuse them with `LlamaLayer.fuse`); norms are float32 vectors. Runtimes read the fields by name
(`layer.qkv`, `layer.attn_norm`, ...).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, ClassVar

import torch

from slipstream.weights.quant import Linear, concat_rows


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor            # [hidden] float32
    ffn_norm: torch.Tensor             # [hidden] float32
    qkv: Linear                        # [(H + 2 KVH) D, hidden], q/k/v biases in its `bias` (Qwen2)
    o: Linear                          # [hidden, H D]
    gate_up: Linear                    # [2 F, hidden]
    down: Linear                       # [hidden, F]
    q_norm: torch.Tensor | None = None   # [D] per-head RMSNorm of q and k (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None   # [hidden] on the attention output (Gemma 3)
    post_ffn_norm: torch.Tensor | None = None    # [hidden] on the MLP output (Gemma 3)

    LINEARS: ClassVar[tuple[str, ...]] = ("qkv", "o", "gate_up", "down")
    VECTORS: ClassVar[tuple[str, ...]] = ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm",
                                          "post_ffn_norm")

    @classmethod
    def fuse(cls, *, attn_norm: torch.Tensor, ffn_norm: torch.Tensor, q: Linear, k: Linear, v: Linear,
             o: Linear, gate: Linear, up: Linear, down: Linear, q_norm: torch.Tensor | None = None,
             k_norm: torch.Tensor | None = None, post_attn_norm: torch.Tensor | None = None,
             post_ffn_norm: torch.Tensor | None = None) -> LlamaLayer:
        """A layer from separate Q/K/V and gate/up products (as checkpoints store them)."""
        return cls(attn_norm, ffn_norm, concat_rows([q, k, v]), o, concat_rows([gate, up]), down, q_norm, k_norm,
                   post_attn_norm, post_ffn_norm)

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def map(self, linear: Callable[[Linear], Linear],
            vector: Callable[[torch.Tensor], torch.Tensor]) -> LlamaLayer:
        """A copy with every product through `linear` and every (present) norm through `vector`."""
        out = {}
        for f in fields(self):
            w = getattr(self, f.name)
            out[f.name] = None if w is None else linear(w) if isinstance(w, Linear) else vector(w)
        return LlamaLayer(**out)
