"""Tensor and expert parallelism: one model split over the ranks of a torch.distributed group
(gloo on the CPU, NCCL on GPUs).

What each rank holds (W ranks, rank r):
  * attention: heads [r H/W, (r+1) H/W) of Q, and KV heads [r KVH/W, (r+1) KVH/W) of K and V
    (column-parallel QKV; its KV cache holds only those KV heads); the output projection's matching
    input columns (row-parallel O), whose partial sums are all-reduced. MLA (DeepSeek, GLM-5) splits
    its heads the same way (q_b / q, kv_b's per-head blocks, O's columns); the shared latent
    (kv_a, the cache of latents and rotary keys) and DSA's indexer are computed on every rank.
  * feed-forward: gate/up rows [r F/W, (r+1) F/W) (column-parallel) and down's matching columns
    (row-parallel, all-reduced); shared experts are split the same way.
  * MoE: experts [r E/W, (r+1) E/W) whole (expert parallelism): the router runs on every rank, each
    rank computes its own experts' share for every token that chose them, and one all-reduce sums
    routed and shared experts' contributions.
  * embedding and LM head: vocabulary rows [r V/W, (r+1) V/W) (vocab-parallel): a token's embedding
    comes from the rank that holds it (all-reduce of masked lookups); logits are all-gathered.

The maths is the model's own: each rank builds the family's model class (`LlamaModel`,
`DeepseekModel`) over its shards with a config of local head / FFN counts, and the sharded forward
calls its RoPE, attention, MLA, router and MLP functions, adding only the collectives.

Rank 0 owns the scheduler: `TensorParallelModel` satisfies the `Model` protocol for the engine and
broadcasts each step description (`step.StepInput`) before running its shard; the other ranks run
`follow`, which executes what rank 0 broadcasts.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slipstream.errors import SlipstreamError
from slipstream.kv.blocks import LatentKVCache, PagedKVCache
from slipstream.models.base import Model
from slipstream.step import StepInput


def _span(n: int, world: int, rank: int, what: str) -> tuple[int, int]:
    if n % world:
        raise SlipstreamError(f"--tensor-parallel {world} does not divide the model's {n} {what}")
    per = n // world
    return rank * per, (rank + 1) * per


def _dense(w: Any) -> torch.Tensor:
    """A weight as a float32 tensor (a `Linear` is dequantized: shards are kept dense)."""
    return w.dequantize().to(torch.float32) if hasattr(w, "dequantize") else w.to(torch.float32)


class Collectives:
    """The three collectives a sharded forward needs, over one process group."""

    def __init__(self, group: Any = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, n] on each rank -> [rows, W n], rank order."""
        if self.world == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                   group=self.group)
        return box[0]


class VocabShard:
    """Rows [lo, hi) of an embedding / LM-head matrix."""

    def __init__(self, full: torch.Tensor, world: int, rank: int):
        self.lo, self.hi = _span(full.shape[0], world, rank, "vocabulary entries")
        self.weight = full[self.lo:self.hi].contiguous()

    def embed(self, ids: torch.Tensor, comm: Collectives) -> torch.Tensor:
        local = ids - self.lo
        mine = (local >= 0) & (local < self.hi - self.lo)
        x = self.weight.index_select(0, local.clamp(0, self.hi - self.lo - 1)) * mine[:, None]
        return comm.all_reduce(x.to(torch.float32))

    def logits(self, h: torch.Tensor, comm: Collectives) -> torch.Tensor:
        return comm.gather_columns(F.linear(h, self.weight.to(h.dtype)))


# -- the Llama family --------------------------------------------------------------------------------

def _shard_llama(model: Any, world: int, rank: int) -> tuple[Any, VocabShard, VocabShard]:
    from slipstream.models.llama import LlamaModel
    from slipstream.weights.layers import LlamaLayer
    from slipstream.weights.quant import Linear

    c = model.cfg
    # the sharded forward below is Llama's plain layer loop: refuse what it would compute wrongly
    # (Gemma 2/3, Phi-3 with LongRoPE or partial rotary, MoE layers)
    why = c.eager_only() if hasattr(c, "eager_only") else None
    if why is not None or not isinstance(model, LlamaModel):
        raise SlipstreamError(f"tensor parallelism does not cover {why or type(model).__name__} yet; "
                              "run it with --tensor-parallel 1")
    H, KVH, D, Fd = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    h0, h1 = _span(H, world, rank, "attention heads")
    k0, k1 = _span(KVH, world, rank, "KV heads")
    f0, f1 = _span(Fd, world, rank, "FFN features")
    q_rows = torch.arange(h0 * D, h1 * D)
    k_rows = H * D + torch.arange(k0 * D, k1 * D)
    v_rows = (H + KVH) * D + torch.arange(k0 * D, k1 * D)
    qkv_rows = torch.cat([q_rows, k_rows, v_rows])
    gu_rows = torch.cat([torch.arange(f0, f1), Fd + torch.arange(f0, f1)])
    layers = []
    for L in model.layers:
        qkv, o, gu, down = _dense(L.qkv), _dense(L.o), _dense(L.gate_up), _dense(L.down)
        qkv_bias = None if L.qkv.bias is None else L.qkv.bias[qkv_rows]
        layers.append(LlamaLayer(
            attn_norm=L.attn_norm, ffn_norm=L.ffn_norm,
            qkv=Linear.dense(qkv[qkv_rows], qkv_bias),
            o=Linear.dense(o[:, h0 * D:h1 * D], L.o.bias if rank == 0 else None),
            gate_up=Linear.dense(gu[gu_rows], None if L.gate_up.bias is None else L.gate_up.bias[gu_rows]),
            down=Linear.dense(down[:, f0:f1], L.down.bias if rank == 0 else None),
            q_norm=L.q_norm, k_norm=L.k_norm))
    embed = VocabShard(_dense(model.embed), world, rank)
    head = embed if model.lm_head is model.embed else VocabShard(_dense(model.lm_head), world, rank)
    local_cfg = replace(c, num_heads=H // world, num_kv_heads=KVH // world, intermediate_size=Fd // world)
    weights: dict[str, Any] = {"embed": Linear.dense(embed.weight), "lm_head": Linear.dense(head.weight),
                               "norm": model.norm, "inv_freq": model.inv_freq}
    weights.update({f"layers.{i}": L for i, L in enumerate(layers)})
    return LlamaModel(local_cfg, weights), embed, head


def _llama_forward(local: Any, embed: VocabShard, head: VocabShard, comm: Collectives, step: StepInput,
                   kv: PagedKVCache) -> torch.Tensor:
    """`LlamaModel.forward` over this rank's heads and FFN features, with the all-reduces."""
    c = local.cfg
    T = step.token_ids.shape[0]
    H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
    qd, kd = H * D, KVH * D
    eps = c.rms_norm_eps
    x = embed.embed(step.token_ids, comm)
    cos, sin = local._rope_tables(step.positions)
    for li, L in enumerate(local.layers):
        h = F.rms_norm(x, (c.hidden_size,), L.attn_norm, eps)
        qkv = L.qkv(h)
        q = qkv[:, :qd].view(T, H, D)
        k = qkv[:, qd:qd + kd].view(T, KVH, D)
        v = qkv[:, qd + kd:].view(T, KVH, D)
        if L.q_norm is not None:
            q = F.rms_norm(q, (D,), L.q_norm, eps)
            k = F.rms_norm(k, (D,), L.k_norm, eps)
        q = local._rope(q, cos, sin)
        k = local._rope(k, cos, sin)
        lk, lv = kv.k[li], kv.v[li]
        lk.index_copy_(0, step.write_slots, k.to(lk.dtype))
        lv.index_copy_(0, step.write_slots, v.to(lv.dtype))
        attn = torch.cat([local._attention(q[s.start:s.start + s.length], lk, lv, s) for s in step.seqs])
        x = x + comm.all_reduce(L.o(attn.reshape(T, qd)))
        h = F.rms_norm(x, (c.hidden_size,), L.ffn_norm, eps)
        gu = L.gate_up(h)
        f = gu.shape[1] // 2
        x = x + comm.all_reduce(L.down(F.silu(gu[:, :f]) * gu[:, f:]))
    last = F.rms_norm(x.index_select(0, step.logits_rows), (c.hidden_size,), local.norm, eps)
    return head.logits(last, comm)


# -- the DeepSeek / GLM family ------------------------------------------------------------------------

def _shard_mlp(w: dict[str, torch.Tensor], world: int, rank: int) -> dict[str, torch.Tensor]:
    gu, down = w["gate_up"], w["down"]
    f = gu.shape[0] // 2
    f0, f1 = _span(f, world, rank, "FFN features")
    return {"gate_up": torch.cat([gu[f0:f1], gu[f + f0:f + f1]]).contiguous(),
            "down": down[:, f0:f1].contiguous()}


def _shard_deepseek(model: Any, world: int, rank: int) -> tuple[Any, VocabShard, VocabShard, tuple[int, int]]:
    from slipstream.models.deepseek import DeepseekModel

    c = model.cfg
    if model.mtp:
        raise SlipstreamError("tensor parallelism does not cover MTP layers yet (serve without --speculative mtp)")
    H = c.num_heads
    h0, h1 = _span(H, world, rank, "attention heads")
    e0, e1 = _span(c.n_routed_experts, world, rank, "routed experts") if c.n_routed_experts else (0, 0)
    layers = {}
    for i, L in enumerate(model.layers):
        w: dict[str, Any] = {k: L[k] for k in ("attn_norm", "ffn_norm") }
        if "indexer" in L:
            w["indexer"] = L["indexer"]                       # the DSA indexer: on every rank
        if c.attention == "mla":
            dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
            for k in ("q_a", "q_a_bias", "q_a_norm", "kv_a", "kv_a_bias", "kv_a_norm"):
                if k in L:
                    w[k] = L[k]                               # the latents: on every rank
            qn = "q_b" if "q_b" in L else "q"
            w[qn] = L[qn][h0 * (dn + dr):h1 * (dn + dr)].contiguous()
            w["kv_b"] = torch.cat([L["w_uk"][h0:h1], L["w_uv"][h0:h1]], dim=1).reshape(-1, c.kv_lora_rank)
            w["o"] = L["o"][:, h0 * dv:h1 * dv].contiguous()
        else:
            D, KVH = c.head_dim, c.num_kv_heads
            k0, k1 = _span(KVH, world, rank, "KV heads")
            qkv, bias = L["qkv"], L["qkv_bias"]
            rows = {"q": torch.arange(h0 * D, h1 * D), "k": H * D + torch.arange(k0 * D, k1 * D),
                    "v": (H + KVH) * D + torch.arange(k0 * D, k1 * D)}
            for n, r in rows.items():
                w[n] = qkv[r].contiguous()
                w[n + "_bias"] = None if bias is None else bias[r].contiguous()
            if c.qk_norm:
                w["q_norm"], w["k_norm"] = L["q_norm"], L["k_norm"]
            w["o"] = L["o"][:, h0 * D:h1 * D].contiguous()
        w["o_bias"] = L.get("o_bias") if rank == 0 else None
        if "moe" in L:
            m = L["moe"]
            w["moe"] = {"router": m["router"], "correction_bias": m["correction_bias"],
                        "gate_up": m["gate_up"][e0:e1].contiguous(), "down": m["down"][e0:e1].contiguous(),
                        "shared": None if m["shared"] is None else _shard_mlp(m["shared"], world, rank)}
        else:
            w["mlp"] = _shard_mlp(L["mlp"], world, rank)
        layers[f"layers.{i}"] = w
    embed = VocabShard(model.embed, world, rank)
    head = embed if model.lm_head is model.embed else VocabShard(model.lm_head, world, rank)
    local_cfg = replace(c, num_heads=H // world, num_kv_heads=c.num_kv_heads // world if c.attention == "gqa" else
                        c.num_kv_heads, intermediate_size=c.intermediate_size // world, num_nextn_predict_layers=0)
    local = DeepseekModel(local_cfg, {"embed": embed.weight, "lm_head": head.weight, "norm": model.norm, **layers})
    return local, embed, head, (e0, e1)


def _moe_local(local: Any, W: dict[str, Any], h: torch.Tensor, experts: tuple[int, int]) -> torch.Tensor:
    """`DeepseekModel._moe` over this rank's experts (and its share of the shared experts): a partial
    sum, completed by the caller's all-reduce."""
    ids, weights = local.route(W, h)
    out = torch.zeros_like(h)
    e0, e1 = experts
    f = W["gate_up"].shape[1] // 2
    for e in ids.unique().tolist():
        if not e0 <= e < e1:
            continue
        rows, slot = (ids == e).nonzero(as_tuple=True)
        gu = F.linear(h.index_select(0, rows), W["gate_up"][e - e0])
        y = F.linear(F.silu(gu[:, :f]) * gu[:, f:], W["down"][e - e0])
        out[rows] += y * weights[rows, slot, None]
    if W["shared"] is not None:
        out += local._mlp(W["shared"], h)
    return out


def _deepseek_forward(local: Any, embed: VocabShard, head: VocabShard, experts: tuple[int, int],
                      comm: Collectives, step: StepInput, kv: Any) -> torch.Tensor:
    """`DeepseekModel.forward` over this rank's heads, FFN features and experts, with the all-reduces."""
    c = local.cfg
    x = embed.embed(step.token_ids, comm)
    cos, sin = local._rope_tables(step.positions)
    shared_sel = None
    for li, L in enumerate(local.layers):
        h = F.rms_norm(x, (c.hidden_size,), L["attn_norm"], c.rms_norm_eps)
        if c.attention == "mla":
            a, shared_sel = local._mla(li, L, h, step, kv, cos, sin, shared_sel)
        else:
            a = local._gqa(li, L, h, step, kv, cos, sin)
        x = x + comm.all_reduce(a)
        h = F.rms_norm(x, (c.hidden_size,), L["ffn_norm"], c.rms_norm_eps)
        ff = _moe_local(local, L["moe"], h, experts) if "moe" in L else local._mlp(L["mlp"], h)
        x = x + comm.all_reduce(ff)
    h = F.rms_norm(x.index_select(0, step.logits_rows), (c.hidden_size,), local.norm, c.rms_norm_eps)
    return head.logits(h, comm)


# -- one rank's shard, and rank 0's face to the engine ----------------------------------------------------

class ShardedModel:
    """This rank's part of a model and its sharded forward."""

    def __init__(self, model: Any, comm: Collectives):
        from slipstream.config import DeepseekConfig

        self.comm = comm
        self.cfg = model.cfg
        self.family = "deepseek" if isinstance(model.cfg, DeepseekConfig) else "llama"
        with torch.inference_mode():
            if self.family == "llama":
                self.local, self.embed, self.head = _shard_llama(model, comm.world, comm.rank)
                self.experts = (0, 0)
            else:
                self.local, self.embed, self.head, self.experts = _shard_deepseek(model, comm.world, comm.rank)

    @torch.inference_mode()
    def forward(self, step: StepInput, kv: Any) -> torch.Tensor:
        if self.family == "llama":
            return _llama_forward(self.local, self.embed, self.head, self.comm, step, kv)
        return _deepseek_forward(self.local, self.embed, self.head, self.experts, self.comm, step, kv)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache | LatentKVCache:
        return self.local.new_kv_cache(num_blocks, block_size)

    def kv_bytes_per_token(self) -> int:
        return self.local.kv_bytes_per_token()


class TensorParallelModel:
    """Rank 0's shard behind the `Model` protocol: the engine drives it as one model; every call
    that the other ranks must mirror (a new KV cache, a step) is broadcast to them first."""

    devices: tuple[str, ...] = ("cpu",)

    def __init__(self, shard: ShardedModel):
        self.shard = shard
        self.cfg = shard.cfg
        self.device = torch.device("cpu")
        self.world = shard.comm.world

    def forward(self, step: StepInput, kv: Any, return_hidden: bool = False) -> torch.Tensor:
        if return_hidden:
            raise SlipstreamError("tensor parallelism does not return hidden states (no MTP speculation)")
        self.shard.comm.broadcast(("step", step))
        return self.shard.forward(step, kv)

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache | LatentKVCache:
        self.shard.comm.broadcast(("kv", num_blocks, block_size))
        return self.shard.new_kv_cache(num_blocks, block_size)

    def kv_bytes_per_token(self) -> int:
        return self.shard.kv_bytes_per_token()

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> Model:
        if torch.device(device).type != "cpu":
            raise SlipstreamError("tensor parallelism runs on the CPU (gloo) for now")
        return self

    def stop(self) -> None:
        """Releases the other ranks from `follow`."""
        self.shard.comm.broadcast(("stop",))


def follow(shard: ShardedModel) -> None:
    """Ranks > 0: run what rank 0 broadcasts (new KV caches, steps) until it says stop."""
    kv: Any = None
    while True:
        msg = shard.comm.broadcast(None)
        if msg[0] == "stop":
            return
        if msg[0] == "kv":
            kv = shard.new_kv_cache(msg[1], msg[2])
        elif msg[0] == "step":
            shard.forward(msg[1], kv)
