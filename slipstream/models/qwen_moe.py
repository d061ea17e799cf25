"""Qwen1.5-MoE / Qwen2-MoE and Qwen3-MoE on the eager step.

Attention is the Llama family's (`DecoderModel`: Qwen2-MoE with q/k/v biases, Qwen3-MoE with q/k
norms); each MoE layer's FFN is
    p = softmax(router(h)) over E experts, the top k kept (renormalized to sum 1 if norm_topk_prob),
    y = sum_k p_k * down_e(silu(gate_e(h)) * up_e(h))  [+ sigmoid(shared_gate(h)) * shared(h), Qwen2-MoE]
Rows are grouped by expert so that each chosen expert's weights are read once per step (as
`models.deepseek.DeepseekModel._moe` does, over `Linear`s here so that GGUF experts stay packed).
Not a `LlamaModel`: the graph and megakernel runtimes refuse it (they have no MoE step). The native CPU
step computes it (`runtime/cpu_plan.py`: ROUTE, EXPERT_GU over the step's active experts, SHARED_GU,
MOE_DOWN; tests/runtime/test_cpu_moe.py), and `auto` picks it on the CPU.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from slipstream.models.llama import DecoderModel, glu
from slipstream.weights.moe import MoeLayer
from slipstream.weights.quant import routed_rows


def _sigmoid_rows(g: torch.Tensor) -> torch.Tensor:
    """sigmoid(g) for g [T, 1] (the shared expert's gate), each row's value the same whatever T: torch's
    vectorized loop leaves the last elements short of two vectors to a scalar tail that rounds differently,
    and splits longer inputs among threads at points that move with T, so a row's gate changed with the number
    of rows beside it. Here every element takes the vector loop: g padded to whole blocks of 64, at most 4096
    elements per call (below torch's thread split)."""
    flat = g.reshape(-1)
    if flat.numel() == 0:   # no rows: torch.cat of no blocks would raise
        return torch.sigmoid(g)
    padded = F.pad(flat, (0, -flat.numel() % 64))
    out = torch.cat([torch.sigmoid(padded[i:i + 4096]) for i in range(0, padded.numel(), 4096)])
    return out[:flat.numel()].view_as(g)


class QwenMoeModel(DecoderModel):

    def route(self, L: MoeLayer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their weights [T, k]) for each row of h."""
        c = self.cfg
        probs = torch.softmax(L.router(h).to(torch.float32), dim=-1)
        w, ids = probs.topk(c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return ids, w

    def _ffn(self, li: int, L: Any, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(L, MoeLayer):   # a dense layer (mlp_only_layers / decoder_sparse_step)
            return super()._ffn(li, L, h, x)
        ids, weights = self.route(L, h)
        out = torch.zeros_like(h)
        f = self.cfg.moe_intermediate_size
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            with routed_rows():   # on the exact path, the same kernels whatever number of rows came here
                gu = L.experts_gate_up[e](h.index_select(0, rows))
                y = L.experts_down[e](glu(gu, f))
            out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))   # a row picks an expert once
        if L.shared_gate_up is not None:
            fs = self.cfg.shared_expert_intermediate_size
            gu = L.shared_gate_up(h)
            y = L.shared_down(glu(gu, fs))
            out += _sigmoid_rows(L.shared_gate(h)) * y
        return x + out
