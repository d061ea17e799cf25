"""The weights of a plan: which models a plan can run, and their weights packed into `W`."""
from __future__ import annotations

from typing import Any

import torch

from slipstream.models.llama import LlamaModel
from slipstream.runtime.plan.format import LAYER_WEIGHTS, WeightLayout, weight_shapes
from slipstream.weights.quant import Linear


def supports(model: Any) -> str | None:
    """None when the megakernel can run `model`, else why not (the caller falls back to another runtime)."""
    if not isinstance(model, LlamaModel):
        return f"needs a Llama-family model, got {type(model).__name__}"
    for i, layer in enumerate(model.layers):
        if layer.qkv.bias is not None:
            return f"layer {i} has q/k/v biases"
        if layer.q_norm is not None or layer.k_norm is not None:
            return f"layer {i} has q/k norms"
    D = model.cfg.head_dim
    if D & (D - 1):
        return f"head_dim {D} is not a power of two"
    if D != 2 * model.inv_freq.numel():
        return "partial rotary embeddings (RoPE over part of the head)"
    return None


def pack_weights(model: LlamaModel, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, WeightLayout]:
    """Every weight of `model`, in `WeightLayout` order, in one new flat tensor (packed GGUF weights
    dequantized); the model is only read."""
    reason = supports(model)
    if reason is not None:
        raise ValueError(f"the megakernel cannot run this model: {reason}")
    cfg = model.cfg
    layout = WeightLayout.for_config(cfg, tied=model.embed is model.lm_head)
    shapes = weight_shapes(cfg)
    W = torch.empty(layout.total, dtype=dtype, device=device)

    def put(offset: int, name: str, w: Linear | torch.Tensor) -> None:
        t = w.dequantize() if isinstance(w, Linear) else w
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name}: expected shape {shapes[name]}, got {tuple(t.shape)}")
        W[offset:offset + t.numel()].copy_(t.reshape(-1))
    for offsets, layer in zip(layout.layers, model.layers):
        for name in LAYER_WEIGHTS:
            put(offsets[name], name, getattr(layer, name))
    put(layout.norm, "norm", model.norm)
    put(layout.lm_head, "lm_head", model.lm_head)
    if not layout.tied:
        put(layout.embed, "embed", model.embed)
    return W, layout


def share_weights(model: LlamaModel, W: torch.Tensor, layout: WeightLayout) -> bool:
    """Points the model's dense matrices at their copies in `W`, so that the eager step (prefill)
    and the megakernel read one copy of the weights instead of two (16 GB saved at dense-8B).
    Packed or differently typed weights are left alone (False).

    This MUTATES `model` in place (each `Linear.data` becomes a view of `W`; the values are equal,
    so its outputs do not change), and deliberately: the engine keeps running prefill on this model
    object, and the point is that it then holds no second copy. `pack_weights` itself only reads."""
    mats = [(getattr(L, name), offs[name]) for L, offs in zip(model.layers, layout.layers)
            for name in ("qkv", "o", "gate_up", "down")]
    mats.append((model.lm_head, layout.lm_head))
    if not layout.tied:
        mats.append((model.embed, layout.embed))
    if any(m.packed or m.data.dtype != W.dtype or m.data.device != W.device for m, _ in mats):
        return False
    for m, off in mats:
        m.data = W[off:off + m.n * m.k].view(m.n, m.k)
    return True

