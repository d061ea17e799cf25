"""Typed per-layer weights of the DeepSeek-V3 / V3.2, GLM-4.5 and GLM-5 family.

What the loader (`weights.safetensors`) writes and `models.deepseek.DeepseekModel`, its MTP step and
`distributed.tensor_parallel` read. Every tensor is a plain float32 `torch.Tensor` (the family runs
in float32 on the CPU); products are [out, in] as `F.linear` takes them.

A `DeepseekLayer` is two norms, one attention (`MlaAttention` for DeepSeek / GLM-5, `GqaAttention`
for GLM-4.5) and one feed-forward (`DenseMlp` for the first dense layers, `DeepseekMoe` after). MLA's
kv_b_proj is held split per head into `w_uk` / `w_uv` (the absorbed decode folds them into the query
and the output); GQA's q/k/v products are held fused. A `MtpLayer` is a decoder layer plus the
next-n prediction head around it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DenseMlp:
    gate_up: torch.Tensor              # [2 F, hidden] (gate rows, then up rows)
    down: torch.Tensor                 # [hidden, F]

    @classmethod
    def fuse(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> DenseMlp:
        return cls(torch.cat([gate, up]), down)


@dataclass
class DeepseekMoe:
    router: torch.Tensor               # [E, hidden]: sigmoid scores
    correction_bias: torch.Tensor | None   # [E] e_score_correction_bias: steers the choice, not the weights
    gate_up: torch.Tensor              # [E, 2 F, hidden] every routed expert's fused gate/up
    down: torch.Tensor                 # [E, hidden, F]
    shared: DenseMlp | None            # the shared experts (always run)

    @classmethod
    def stack(cls, router: torch.Tensor, correction_bias: torch.Tensor | None, experts: list[DenseMlp],
              shared: DenseMlp | None) -> DeepseekMoe:
        """A MoE layer from its experts as checkpoints store them (one module per expert)."""
        return cls(router, correction_bias, torch.stack([e.gate_up for e in experts]),
                   torch.stack([e.down for e in experts]), shared)


@dataclass
class Indexer:
    """DeepSeek Sparse Attention's lightning indexer (V3.2, GLM-5)."""
    wq_b: torch.Tensor                 # [Hi Di, q_lora_rank]: its query heads from the q latent
    wk: torch.Tensor                   # [Di, hidden]: its one key head
    k_norm: torch.Tensor               # [Di] LayerNorm weight and bias of that key
    k_norm_bias: torch.Tensor
    weights_proj: torch.Tensor         # [Hi, hidden]: per-head weights from the hidden state


@dataclass
class MlaAttention:
    """Multi-head latent attention. With a q latent (`q_lora_rank`): q_a -> q_a_norm -> q_b; without
    one: q. kv_a gives the kv latent (kv_lora_rank) and the shared rotary key (qk_rope_head_dim)."""
    kv_a: torch.Tensor                 # [r + dr, hidden]
    kv_a_norm: torch.Tensor            # [r]
    w_uk: torch.Tensor                 # [H, dn, r]: latent -> key (no rope part)
    w_uv: torch.Tensor                 # [H, dv, r]: latent -> value
    o: torch.Tensor                    # [hidden, H dv]
    q: torch.Tensor | None = None      # [H (dn + dr), hidden] (no q latent)
    q_a: torch.Tensor | None = None    # [q_lora_rank, hidden]
    q_a_norm: torch.Tensor | None = None   # [q_lora_rank]
    q_b: torch.Tensor | None = None    # [H (dn + dr), q_lora_rank]
    q_a_bias: torch.Tensor | None = None
    kv_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    indexer: Indexer | None = None     # DSA; None on dense layers and GLM-5's "shared" layers

    @staticmethod
    def split_kv_b(kv_b: torch.Tensor, heads: int, nope_dim: int, v_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [H, dn, r], w_uv [H, dv, r]) from kv_b_proj [H (dn + dv), r]."""
        per_head = kv_b.view(heads, nope_dim + v_dim, -1)
        return per_head[:, :nope_dim].contiguous(), per_head[:, nope_dim:].contiguous()

    def kv_b(self) -> torch.Tensor:
        """kv_b_proj as checkpoints store it, [H (dn + dv), r]."""
        return torch.cat([self.w_uk, self.w_uv], dim=1).reshape(-1, self.w_uk.shape[-1])


@dataclass
class GqaAttention:
    """GLM-4.5's Llama-like attention: fused q/k/v (with biases), optional per-head q/k RMSNorm."""
    qkv: torch.Tensor                  # [(H + 2 KVH) D, hidden]
    o: torch.Tensor                    # [hidden, H D]
    qkv_bias: torch.Tensor | None = None   # [(H + 2 KVH) D]
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None     # [D]
    k_norm: torch.Tensor | None = None

    @classmethod
    def fuse(cls, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             q_bias: torch.Tensor | None = None, k_bias: torch.Tensor | None = None,
             v_bias: torch.Tensor | None = None, o_bias: torch.Tensor | None = None,
             q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None) -> GqaAttention:
        """Attention from separate q/k/v products (as checkpoints store them); a missing bias of
        one of them is zeros when another has one."""
        biases = (q_bias, k_bias, v_bias)
        qkv_bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(t.shape[0]) for b, t in zip(biases, (q, k, v))])
        return cls(torch.cat([q, k, v]).contiguous(), o, qkv_bias, o_bias, q_norm, k_norm)


@dataclass
class DeepseekLayer:
    attn_norm: torch.Tensor            # [hidden]
    ffn_norm: torch.Tensor             # [hidden]
    attn: MlaAttention | GqaAttention
    ffn: DenseMlp | DeepseekMoe


@dataclass
class MtpLayer(DeepseekLayer):
    """One next-n prediction layer: x = eh_proj([enorm(embed(t)) ; hnorm(hidden)]), the decoder
    layer, logits = head(head_norm(x)). `embed` / `head` are None where the checkpoint shares the
    main model's (the model reads its own then)."""
    enorm: torch.Tensor                # [hidden]
    hnorm: torch.Tensor                # [hidden]
    eh_proj: torch.Tensor              # [hidden, 2 hidden]
    head_norm: torch.Tensor            # [hidden] shared_head.norm
    head: torch.Tensor | None = None   # [vocab, hidden] shared_head.head
    embed: torch.Tensor | None = None  # [vocab, hidden]
