"""Typed weights of a mixture-of-experts layer (Qwen2-MoE, Qwen3-MoE) and how the loaders fill them.

A `MoeLayer` has a Llama-family layer's attention weights under the same names (`attn_norm`, `qkv`,
`o`, `q_norm`, `k_norm`; read by `models.llama.DecoderModel`'s attention) and, instead of one MLP,
a router over E experts, each expert's fused gate/up and down products (kept as the file stores
them: packed GGUF blocks stay packed) and, for Qwen2-MoE, a shared expert behind a sigmoid gate.
Dense layers of such a model (`mlp_only_layers`, `decoder_sparse_step`) stay `LlamaLayer`s.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar

import torch

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.weights.layers import LlamaLayer
from slipstream.weights.quant import Linear, concat_rows


@dataclass
class MoeLayer:
    attn_norm: torch.Tensor              # [hidden] float32
    ffn_norm: torch.Tensor               # [hidden] float32
    qkv: Linear                          # [(H + 2 KVH) D, hidden], biases (Qwen2-MoE) in its `bias`
    o: Linear                            # [hidden, H D]
    router: Linear                       # [E, hidden]
    experts_gate_up: list[Linear]        # E x [2 F, hidden] (gate rows, then up rows)
    experts_down: list[Linear]           # E x [hidden, F]
    shared_gate_up: Linear | None = None   # [2 Fs, hidden] (Qwen2-MoE)
    shared_down: Linear | None = None      # [hidden, Fs]
    shared_gate: Linear | None = None      # [1, hidden]: sigmoid(h . w) scales the shared expert
    q_norm: torch.Tensor | None = None     # [D] (Qwen3-MoE)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = field(default=None, repr=False)   # (none: read by the shared step)
    post_ffn_norm: torch.Tensor | None = field(default=None, repr=False)

    LINEARS: ClassVar[tuple[str, ...]] = ("qkv", "o", "router", "shared_gate_up", "shared_down", "shared_gate")

    def linears(self) -> list[Linear]:
        out = [getattr(self, n) for n in self.LINEARS if getattr(self, n) is not None]
        return out + self.experts_gate_up + self.experts_down

    def map(self, linear: Callable[[Linear], Linear],
            vector: Callable[[torch.Tensor], torch.Tensor]) -> MoeLayer:
        """A copy with every product through `linear` and every (present) norm through `vector`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            w = getattr(self, f.name)
            if isinstance(w, list):
                out[f.name] = [linear(x) for x in w]
            else:
                out[f.name] = None if w is None else linear(w) if isinstance(w, Linear) else vector(w)
        return MoeLayer(**out)


def qwen_moe_layers_hf(cfg: ModelConfig, get: Callable[[str], torch.Tensor],
                       lin: Callable[[str], Linear]) -> dict[str, Any]:
    """`layers.{i}` of a Qwen2-MoE / Qwen3-MoE Hugging Face checkpoint: experts as saved by
    transformers (one module per expert) or fused ([E, 2F, hidden] gate_up_proj, [E, hidden, F]
    down_proj)."""
    out: dict[str, Any] = {}

    def has(name: str) -> bool:
        try:
            get(name)
        except ModelLoadError:
            return False
        return True

    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn = dict(attn_norm=get(p + "input_layernorm.weight"), ffn_norm=get(p + "post_attention_layernorm.weight"),
                    qkv=concat_rows([lin(a + "q_proj"), lin(a + "k_proj"), lin(a + "v_proj")]), o=lin(a + "o_proj"),
                    q_norm=get(a + "q_norm.weight") if cfg.qk_norm else None,
                    k_norm=get(a + "k_norm.weight") if cfg.qk_norm else None)
        m = p + "mlp."
        if not cfg.is_moe(i):
            out[f"layers.{i}"] = LlamaLayer(gate_up=concat_rows([lin(m + "gate_proj"), lin(m + "up_proj")]),
                                            down=lin(m + "down_proj"), **attn)
            continue
        E = cfg.num_experts
        if has(m + "experts.gate_up_proj"):
            gu, dn = get(m + "experts.gate_up_proj"), get(m + "experts.down_proj")
            gate_up = [Linear.dense(gu[e]) for e in range(E)]
            down = [Linear.dense(dn[e]) for e in range(E)]
        else:
            gate_up = [Linear.dense(torch.cat([get(m + f"experts.{e}.gate_proj.weight"),
                                               get(m + f"experts.{e}.up_proj.weight")])) for e in range(E)]
            down = [lin(m + f"experts.{e}.down_proj") for e in range(E)]
        shared: dict[str, Any] = {}
        if cfg.shared_expert_intermediate_size:
            s = m + "shared_expert."
            shared = dict(shared_gate_up=concat_rows([lin(s + "gate_proj"), lin(s + "up_proj")]),
                          shared_down=lin(s + "down_proj"), shared_gate=lin(m + "shared_expert_gate"))
        out[f"layers.{i}"] = MoeLayer(router=lin(m + "gate"), experts_gate_up=gate_up, experts_down=down,
                                      **shared, **attn)
    return out


def qwen_moe_layers_gguf(cfg: ModelConfig, tensors: dict[str, Any], vec: Callable[[str], torch.Tensor],
                         lin: Callable[[str], Linear], experts: Callable[[Any], list[Linear]]) -> dict[str, Any]:
    """`layers.{i}` of a qwen2moe / qwen3moe GGUF: stacked experts ffn_{gate,up,down}_exps (each
    expert's rows kept in the file's type), router ffn_gate_inp, shared expert ffn_*_shexp with its
    gate ffn_gate_inp_shexp."""
    out: dict[str, Any] = {}

    def stacked(name: str) -> list[Linear]:
        if name not in tensors:
            raise ModelLoadError(f"tensor {name} missing")
        return experts(tensors[name])

    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        attn = dict(attn_norm=vec(p + "attn_norm.weight"), ffn_norm=vec(p + "ffn_norm.weight"),
                    qkv=concat_rows([lin(p + "attn_q.weight"), lin(p + "attn_k.weight"), lin(p + "attn_v.weight")]),
                    o=lin(p + "attn_output.weight"),
                    q_norm=vec(p + "attn_q_norm.weight") if cfg.qk_norm else None,
                    k_norm=vec(p + "attn_k_norm.weight") if cfg.qk_norm else None)
        if not cfg.is_moe(i):
            out[f"layers.{i}"] = LlamaLayer(
                gate_up=concat_rows([lin(p + "ffn_gate.weight"), lin(p + "ffn_up.weight")]),
                down=lin(p + "ffn_down.weight"), **attn)
            continue
        gates, ups = stacked(p + "ffn_gate_exps.weight"), stacked(p + "ffn_up_exps.weight")
        shared: dict[str, Any] = {}
        if p + "ffn_gate_inp_shexp.weight" in tensors:
            g = vec(p + "ffn_gate_inp_shexp.weight")
            shared = dict(shared_gate_up=concat_rows([lin(p + "ffn_gate_shexp.weight"), lin(p + "ffn_up_shexp.weight")]),
                          shared_down=lin(p + "ffn_down_shexp.weight"), shared_gate=Linear.dense(g.reshape(1, -1)))
        out[f"layers.{i}"] = MoeLayer(router=lin(p + "ffn_gate_inp.weight"),
                                      experts_gate_up=[concat_rows([g, u]) for g, u in zip(gates, ups)],
                                      experts_down=stacked(p + "ffn_down_exps.weight"), **shared, **attn)
    return out
