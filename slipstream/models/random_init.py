"""Llama-family models with random weights at any shape: for speed benchmarks at real shapes
(`benchmarks/gpu_decode.py`) and for tests of the fast runtimes against the eager step."""
from __future__ import annotations

import torch

from slipstream.config import ModelConfig
from slipstream.models.llama import LlamaModel
from slipstream.weights.layers import LlamaLayer
from slipstream.weights.quant import Linear

SHAPES: dict[str, dict] = {   # the GPU benchmark shapes (DESIGN.md, "Measuring")
    "dense-1B": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                     intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, max_position_embeddings=131072),
    "dense-8B": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                     rope_theta=500000.0, max_position_embeddings=131072),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=256, tie_word_embeddings=True,
                 max_position_embeddings=1024),
}


def shape_config(name: str, **overrides) -> ModelConfig:
    return ModelConfig(architecture="llama", rms_norm_eps=1e-5, **{**SHAPES[name], **overrides})


def random_llama(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0) -> LlamaModel:
    """A LlamaModel with N(0, 0.02) weights and unit-ish norms, built directly on `device`."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    H, KVH, D, Hd, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size

    def mat(n: int, k: int) -> Linear:
        w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=dtype)
        return Linear(n, k, w)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(device=device, dtype=torch.float32)

    weights: dict = {"embed": mat(cfg.vocab_size, Hd), "norm": norm(Hd)}
    weights["lm_head"] = weights["embed"] if cfg.tie_word_embeddings else mat(cfg.vocab_size, Hd)
    for i in range(cfg.num_layers):
        weights[f"layers.{i}"] = LlamaLayer(attn_norm=norm(Hd), ffn_norm=norm(Hd),
                                            qkv=mat((H + 2 * KVH) * D, Hd), o=mat(Hd, H * D),
                                            gate_up=mat(2 * F, Hd), down=mat(Hd, F))
    model = LlamaModel(cfg, weights)
    model.inv_freq = model.inv_freq.to(device)
    return model
