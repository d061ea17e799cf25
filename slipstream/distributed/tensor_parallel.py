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

The maths is the model's own. The Llama family (Llama, Qwen2/3, Mistral, SmolLM2, Gemma 2/3, Phi-3)
runs `DecoderModel.forward` itself on every rank, over a `LlamaModel` of local head / FFN counts whose
O and DOWN products are `RowParallelLinear`s (all-reduce) and whose embedding and LM head are
`VocabParallelLinear`s: every feature of the eager step comes with it. The DeepSeek family builds
`DeepseekModel` over its shards and its sharded forward calls that model's RoPE, attention, MLA,
router and MLP functions, adding the collectives.

Ranks cut their shards from the loader's weights (`ShardedModel.from_weights`) and keep them as
stored: packed weights stay packed (rows selected; columns cut on block boundaries, or dequantized a
few rows at a time where a cut falls inside a block), so no rank holds a float32 copy of the whole
model, and each full weight is dropped as soon as its shard exists. On CUDA machines the group is NCCL with
rank r on cuda:LOCAL_RANK and its shard there in bf16 (`rank_device`); rank 0's step descriptions
travel over a gloo group beside it.

Rank 0 owns the scheduler: `TensorParallelModel` satisfies the `Model` protocol for the engine and
broadcasts each step description (`step.StepInput`) before running its shard; the other ranks run
`follow`, which executes what rank 0 broadcasts.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slipstream.errors import SlipstreamError
from slipstream.kv.blocks import HybridKVCache, LatentKVCache, PagedKVCache
from slipstream.models.base import Model
from slipstream.step import StepInput
from slipstream.weights.deepseek import DeepseekLayer, DeepseekMoe, DenseMlp, GqaAttention, MlaAttention
from slipstream.weights.quant import RAW_TYPES, Linear


def _span(n: int, world: int, rank: int, what: str) -> tuple[int, int]:
    if n % world:
        raise SlipstreamError(f"--tensor-parallel {world} does not divide the model's {n} {what}")
    per = n // world
    return rank * per, (rank + 1) * per


class Collectives:
    """The three collectives a sharded forward needs, over one process group."""

    def __init__(self, group: Any = None, control: Any = None):
        self.group = group
        self.control = control   # the group for `broadcast` (rank 0's messages); None: `group`
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
        """Rank 0's `obj` on every rank (pickled; over `control`, a gloo group beside NCCL)."""
        g = self.control if self.control is not None else self.group
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(g, 0) if g is not None else 0, group=g)
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
#
# No second copy of the layer loop: each rank runs `DecoderModel.forward` itself (Gemma's post-norms,
# GeGLU, embedding scale, sliding windows and soft-capping, Phi-3's LongRoPE and partial rotary, Qwen's
# biases and q/k norms all come with it) over a `LlamaModel` of local head / FFN counts whose four
# cross-rank products are `Linear`s that add the collectives: the row-parallel O and DOWN all-reduce
# their partial sums (before Gemma's post-norms, which `forward` applies to what they return), the
# vocabulary-parallel embedding all-reduces its masked lookups and the LM head all-gathers its logits
# (before Gemma 2's final soft-capping).

@dataclass
class RowParallelLinear(Linear):
    """This rank's input columns of a row-parallel product (attention output, MLP down): its partial
    sum x_r @ W_r.T, all-reduced over the ranks (the bias on rank 0 only), then written or added to
    `out` as `Linear.__call__` does."""
    comm: Any = None

    @classmethod
    def wrap(cls, w: Linear, comm: Collectives) -> RowParallelLinear:
        return cls(**{f.name: getattr(w, f.name) for f in fields(Linear)}, comm=comm)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 accumulate: bool = False) -> torch.Tensor:
        y = self.comm.all_reduce(Linear.__call__(self, x))
        if out is None:
            return y
        return out.add_(y) if accumulate else out.copy_(y)


@dataclass
class VocabParallelLinear(Linear):
    """Vocabulary rows [lo, lo + n) of the embedding / LM head: a lookup takes the rows this rank
    holds (zeros for the others) and all-reduces them; a product's logits are all-gathered (rank order
    is vocabulary order)."""
    lo: int = 0
    comm: Any = None

    @classmethod
    def wrap(cls, w: Linear, lo: int, comm: Collectives) -> VocabParallelLinear:
        return cls(**{f.name: getattr(w, f.name) for f in fields(Linear)}, lo=lo, comm=comm)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is None:
            return Linear.dequantize(self)
        local = rows - self.lo
        mine = (local >= 0) & (local < self.n)
        x = Linear.dequantize(self, local.clamp(0, self.n - 1)).to(torch.float32) * mine[:, None]
        return self.comm.all_reduce(x)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 accumulate: bool = False) -> torch.Tensor:
        y = self.comm.gather_columns(Linear.__call__(self, x))
        if out is None:
            return y
        return out.add_(y) if accumulate else out.copy_(y)


ROW_CHUNK = 256   # rows dequantized at a time when a packed weight cannot be cut by columns in place


def _rows(w: Linear, rows: torch.Tensor) -> Linear:
    """Rows of a weight (with their bias), kept as stored: a packed or memory-mapped weight is cut,
    never dequantized whole."""
    if not w.packed:
        return Linear.dense(w.data[rows], _bias(w, rows))
    return w.select_rows(rows)


def _block_cols(w: Linear, c0: int, c1: int) -> Linear | None:
    """Columns [c0, c1) of a packed weight as a packed weight, when they start and end on its blocks
    (32 weights for Q4_0/Q4_1/Q8_0/Q4_K's layout, the block of a raw GGUF type); else None."""
    if w.parts or w.fmt is None:
        return None
    if w.reblocked:   # Q5_0/Q5_1/IQ4_NL laid out by planes: cut through the ggml blocks they came from
        return w.block_cols(c0, c1)
    if w.raw:
        _, qk, bb = RAW_TYPES[w.fmt]
        if c0 % qk or c1 % qk:
            return None
        return Linear(w.n, c1 - c0, w.data[:, c0 // qk * bb:c1 // qk * bb].contiguous(), w.fmt)
    if c0 % 32 or c1 % 32 or (w.scale is None and w.kq is None):
        return None
    per = w.data.shape[1] // (w.k // 32)    # code bytes per block of 32
    pick = lambda t: None if t is None else t[:, c0 // 32:c1 // 32].contiguous()  # noqa: E731
    data = w.data[:, c0 // 32 * per:c1 // 32 * per].contiguous()
    if w.kq is not None:   # Q4_K's 6-bit form: cut on its super-blocks of 256, else fp32 planes for the shard
        if c0 % 256 == 0 and c1 % 256 == 0:
            sc, mn, dd = w.kq
            g0, g1 = c0 // 32, c1 // 32
            return Linear(w.n, c1 - c0, data, w.fmt, kq=(sc[:, g0:g1].contiguous(), mn[:, g0:g1].contiguous(),
                                                         dd[:, c0 // 256:c1 // 256].contiguous()))
        scale, mins = w.planes()
        return Linear(w.n, c1 - c0, data, w.fmt, pick(scale), pick(mins))
    return Linear(w.n, c1 - c0, data, w.fmt, pick(w.scale), pick(w.min))


def _cols(w: Linear, c0: int, c1: int, bias: bool) -> Linear:
    """Columns [c0, c1) of a weight (the bias only where `bias`: rank 0 of a row-parallel product):
    packed blocks cut in place where the columns align with them, else float32, dequantized
    `ROW_CHUNK` rows at a time (only the shard and one chunk are ever float32)."""
    b = _bias(w) if bias else None
    cut = _block_cols(w, c0, c1)
    if cut is not None:
        cut.bias = b
        return cut
    if not w.packed:
        return Linear.dense(w.data[:, c0:c1], b)
    out = torch.empty(w.n, c1 - c0, dtype=torch.float32)
    for r in range(0, w.n, ROW_CHUNK):
        rows = torch.arange(r, min(w.n, r + ROW_CHUNK))
        out[r:r + rows.numel()] = w.dequantize(rows)[:, c0:c1]
    return Linear.dense(out, b)


def _bias(w: Linear, rows: torch.Tensor | None = None) -> torch.Tensor | None:
    if w.bias is None:
        return None
    return (w.bias if rows is None else w.bias[rows]).to(torch.float32).contiguous()


def _refuse_moe(cfg: Any) -> None:
    """The one feature of the family the sharded step does not split yet: Qwen MoE's experts."""
    if getattr(cfg, "num_experts", 0):
        raise SlipstreamError(f"tensor parallelism does not cover {cfg.eager_only()} yet; "
                              "run it with --tensor-parallel 1")


def shard_llama_weights(cfg: Any, weights: dict[str, Any], world: int, rank: int) -> tuple[Any, dict[str, Any], int]:
    """(local config, local weights, first vocabulary row) of rank `rank`: its heads, FFN features and
    vocabulary rows cut from the loader's weights and kept as stored (packed weights stay packed; a
    column cut that does not fall on their blocks becomes float32, dequantized a few rows at a time).
    Entries of `weights` are removed as they are sharded, so each full weight can be freed as soon as
    its shard exists."""
    _refuse_moe(cfg)
    H, KVH, D, Fd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    h0, h1 = _span(H, world, rank, "attention heads")
    k0, k1 = _span(KVH, world, rank, "KV heads")
    f0, f1 = _span(Fd, world, rank, "FFN features")
    v0, v1 = _span(cfg.vocab_size, world, rank, "vocabulary entries")
    qkv_rows = torch.cat([torch.arange(h0 * D, h1 * D), H * D + torch.arange(k0 * D, k1 * D),
                          (H + KVH) * D + torch.arange(k0 * D, k1 * D)])
    gu_rows = torch.cat([torch.arange(f0, f1), Fd + torch.arange(f0, f1)])
    out: dict[str, Any] = {"norm": weights.pop("norm")}
    for key in ("inv_freq", "rope_freqs"):
        if key in weights:
            out[key] = weights.pop(key)
    for i in range(cfg.num_layers):
        L = weights.pop(f"layers.{i}")
        out[f"layers.{i}"] = dataclasses.replace(
            L, qkv=_rows(L.qkv, qkv_rows), o=_cols(L.o, h0 * D, h1 * D, rank == 0),
            gate_up=_rows(L.gate_up, gu_rows), down=_cols(L.down, f0, f1, rank == 0))
        del L
    vocab = torch.arange(v0, v1)
    embed, head = weights.pop("embed"), weights.pop("lm_head")
    out["embed"] = _rows(embed, vocab)
    out["lm_head"] = out["embed"] if head is embed else _rows(head, vocab)
    local_cfg = replace(cfg, num_heads=H // world, num_kv_heads=KVH // world, intermediate_size=Fd // world)
    return local_cfg, out, v0


def _model_weights(model: Any) -> dict[str, Any]:
    w: dict[str, Any] = {"embed": model.embed, "lm_head": model.lm_head, "norm": model.norm,
                         "inv_freq": model.inv_freq}
    w.update({f"layers.{i}": L for i, L in enumerate(model.layers)})
    return w


def _shard_llama(model: Any, world: int, rank: int) -> tuple[Any, int]:
    """Rank `rank`'s `LlamaModel` (plain `Linear`s, not yet wired to the collectives) and its first
    vocabulary row, from a whole model."""
    from slipstream.models.llama import LlamaModel

    _refuse_moe(model.cfg)
    if not isinstance(model, LlamaModel):
        raise SlipstreamError(f"tensor parallelism does not cover {type(model).__name__} yet; "
                              "run it with --tensor-parallel 1")
    cfg, weights, lo = shard_llama_weights(model.cfg, _model_weights(model), world, rank)
    return LlamaModel(cfg, weights), lo


def _parallelize(local: Any, vocab_lo: int, comm: Collectives) -> Any:
    """Wires a local `LlamaModel` (already on its device) to the collectives: O and DOWN row-parallel,
    embedding and LM head vocabulary-parallel (a tied pair stays one object)."""
    tied = local.lm_head is local.embed
    local.embed = VocabParallelLinear.wrap(local.embed, vocab_lo, comm)
    local.lm_head = local.embed if tied else VocabParallelLinear.wrap(local.lm_head, vocab_lo, comm)
    local.layers = [dataclasses.replace(L, o=RowParallelLinear.wrap(L.o, comm),
                                        down=RowParallelLinear.wrap(L.down, comm)) for L in local.layers]
    return local


# -- the DeepSeek / GLM family ------------------------------------------------------------------------

def _shard_mlp(w: DenseMlp, world: int, rank: int) -> DenseMlp:
    f = w.gate_up.shape[0] // 2
    f0, f1 = _span(f, world, rank, "FFN features")
    return DenseMlp(torch.cat([w.gate_up[f0:f1], w.gate_up[f + f0:f + f1]]).contiguous(),
                    w.down[:, f0:f1].contiguous())


def _shard_attention(c: Any, A: MlaAttention | GqaAttention, world: int, rank: int
                     ) -> MlaAttention | GqaAttention:
    """This rank's heads of one layer's attention; O's bias on rank 0 only (added once by the all-reduce)."""
    H = c.num_heads
    h0, h1 = _span(H, world, rank, "attention heads")
    o_bias = A.o_bias if rank == 0 else None
    if isinstance(A, MlaAttention):
        dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        # the latents (q_a, kv_a, their norms) and the DSA indexer: on every rank
        heads = slice(h0 * (dn + dr), h1 * (dn + dr))
        return replace(A, q=None if A.q is None else A.q[heads].contiguous(),
                       q_b=None if A.q_b is None else A.q_b[heads].contiguous(),
                       w_uk=A.w_uk[h0:h1].contiguous(), w_uv=A.w_uv[h0:h1].contiguous(),
                       o=A.o[:, h0 * dv:h1 * dv].contiguous(), o_bias=o_bias)
    D, KVH = c.head_dim, c.num_kv_heads
    k0, k1 = _span(KVH, world, rank, "KV heads")
    rows = torch.cat([torch.arange(h0 * D, h1 * D), H * D + torch.arange(k0 * D, k1 * D),
                      (H + KVH) * D + torch.arange(k0 * D, k1 * D)])
    return replace(A, qkv=A.qkv[rows].contiguous(),
                   qkv_bias=None if A.qkv_bias is None else A.qkv_bias[rows].contiguous(),
                   o=A.o[:, h0 * D:h1 * D].contiguous(), o_bias=o_bias)


def _shard_deepseek(model: Any, world: int, rank: int) -> tuple[Any, VocabShard, VocabShard, tuple[int, int]]:
    from slipstream.models.deepseek import DeepseekModel

    c = model.cfg
    if model.mtp:
        raise SlipstreamError("tensor parallelism does not cover MTP layers yet (serve without --speculative mtp)")
    _span(c.num_heads, world, rank, "attention heads")
    e0, e1 = _span(c.n_routed_experts, world, rank, "routed experts") if c.n_routed_experts else (0, 0)
    layers = {}
    for i, L in enumerate(model.layers):
        ffn: DenseMlp | DeepseekMoe
        if isinstance(L.ffn, DeepseekMoe):
            m = L.ffn
            ffn = DeepseekMoe(m.router, m.correction_bias, m.gate_up[e0:e1].contiguous(), m.down[e0:e1].contiguous(),
                              None if m.shared is None else _shard_mlp(m.shared, world, rank))
        else:
            ffn = _shard_mlp(L.ffn, world, rank)
        layers[f"layers.{i}"] = DeepseekLayer(L.attn_norm, L.ffn_norm, _shard_attention(c, L.attn, world, rank), ffn)
    embed = VocabShard(model.embed, world, rank)
    head = embed if model.lm_head is model.embed else VocabShard(model.lm_head, world, rank)
    local_cfg = replace(c, num_heads=c.num_heads // world, num_kv_heads=c.num_kv_heads // world
                        if c.attention == "gqa" else c.num_kv_heads, intermediate_size=c.intermediate_size // world,
                        num_nextn_predict_layers=0)
    local = DeepseekModel(local_cfg, {"embed": embed.weight, "lm_head": head.weight, "norm": model.norm, **layers})
    return local, embed, head, (e0, e1)


def _moe_local(local: Any, W: DeepseekMoe, h: torch.Tensor, experts: tuple[int, int]) -> torch.Tensor:
    """`DeepseekModel._moe` over this rank's experts (and its share of the shared experts): a partial
    sum, completed by the caller's all-reduce."""
    ids, weights = local.route(W, h)
    out = torch.zeros_like(h)
    e0, e1 = experts
    f = W.gate_up.shape[1] // 2
    for e in ids.unique().tolist():
        if not e0 <= e < e1:
            continue
        rows, slot = (ids == e).nonzero(as_tuple=True)
        gu = F.linear(h.index_select(0, rows), W.gate_up[e - e0])
        y = F.linear(F.silu(gu[:, :f]) * gu[:, f:], W.down[e - e0])
        out[rows] += y * weights[rows, slot, None]
    if W.shared is not None:
        out += local._mlp(W.shared, h)
    return out


def _deepseek_forward(local: Any, embed: VocabShard, head: VocabShard, experts: tuple[int, int],
                      comm: Collectives, step: StepInput, kv: Any) -> torch.Tensor:
    """`DeepseekModel.forward` over this rank's heads, FFN features and experts, with the all-reduces."""
    c = local.cfg
    x = embed.embed(step.token_ids, comm)
    cos, sin = local._rope_tables(step.positions)
    shared_sel = None
    for li, L in enumerate(local.layers):
        h = F.rms_norm(x, (c.hidden_size,), L.attn_norm, c.rms_norm_eps)
        a, shared_sel = local.attention(li, L.attn, h, step, kv, cos, sin, shared_sel)
        x = x + comm.all_reduce(a)
        h = F.rms_norm(x, (c.hidden_size,), L.ffn_norm, c.rms_norm_eps)
        ff = _moe_local(local, L.ffn, h, experts) if isinstance(L.ffn, DeepseekMoe) else local._mlp(L.ffn, h)
        x = x + comm.all_reduce(ff)
    h = F.rms_norm(x.index_select(0, step.logits_rows), (c.hidden_size,), local.norm, c.rms_norm_eps)
    return head.logits(h, comm)


# -- one rank's shard, and rank 0's face to the engine ----------------------------------------------------

def rank_device(world: int, rank: int) -> tuple[str, torch.device]:
    """(backend, device) of one rank: NCCL with rank r on cuda:LOCAL_RANK (r when unset) where CUDA is
    available, else gloo on the CPU. `SLIPSTREAM_TP_DEVICE=cpu` keeps a GPU machine on gloo;
    `=cuda` insists on GPUs. A machine with fewer GPUs than its ranks is refused, not oversubscribed."""
    want = os.environ.get("SLIPSTREAM_TP_DEVICE", "auto").lower()
    if want not in ("auto", "cpu", "cuda"):
        raise SlipstreamError(f"SLIPSTREAM_TP_DEVICE must be auto, cpu or cuda, got {want!r}")
    cuda = torch.cuda.is_available()
    if want == "cpu" or (want == "auto" and not cuda):
        return "gloo", torch.device("cpu")
    if not cuda:
        raise SlipstreamError("SLIPSTREAM_TP_DEVICE=cuda, but torch sees no CUDA device")
    n = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if n < local_world:
        raise SlipstreamError(f"--tensor-parallel {world} runs one rank per GPU, but this machine has {n} "
                              f"CUDA device(s); use --tensor-parallel {n} or fewer (or SLIPSTREAM_TP_DEVICE=cpu "
                              "for gloo on the CPU)")
    local = int(os.environ.get("LOCAL_RANK", rank))
    if not 0 <= local < n:
        raise SlipstreamError(f"LOCAL_RANK {local} names no CUDA device (this machine has {n})")
    return "nccl", torch.device("cuda", local)


def control_group() -> Any:
    """The group that carries rank 0's messages (pickled step descriptions, on the CPU): gloo beside
    an NCCL group (every rank must call this at the same point), the default group otherwise."""
    if dist.get_backend() == "nccl":
        return dist.new_group(backend="gloo")
    return None


def _trim_heap() -> None:
    """Hands the heap the whole weights occupied back to the OS once only the shard is left (glibc
    keeps freed memory otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


class ShardedModel:
    """This rank's part of a model and its sharded forward: the Llama family runs the model's own
    `DecoderModel.forward` over local weights wired to the collectives; the DeepSeek family its
    sharded forward above."""

    def __init__(self, model: Any, comm: Collectives, device: torch.device | str = "cpu"):
        from slipstream.config import DeepseekConfig

        self._setup(model.cfg, comm, device)
        with torch.inference_mode():
            if not isinstance(model.cfg, DeepseekConfig):
                local, lo = _shard_llama(model, comm.world, comm.rank)
                self._place_llama(local, lo)
            else:
                self._shard_deepseek(model)

    @classmethod
    def from_weights(cls, cfg: Any, weights: dict[str, Any], comm: Collectives,
                     device: torch.device | str = "cpu") -> ShardedModel:
        """From a loader's config and weights, without building the whole model: each rank cuts its
        shard from the (packed or memory-mapped) weights and drops them from `weights` as it goes."""
        from slipstream.config import DeepseekConfig
        from slipstream.models import build_model
        from slipstream.models.llama import LlamaModel

        self = cls.__new__(cls)
        self._setup(cfg, comm, device)
        with torch.inference_mode():
            if isinstance(cfg, DeepseekConfig):
                self._shard_deepseek(build_model(cfg, weights))
                weights.clear()
            else:
                local_cfg, local_w, lo = shard_llama_weights(cfg, weights, comm.world, comm.rank)
                self._place_llama(LlamaModel(local_cfg, local_w), lo)
        _trim_heap()
        return self

    def _setup(self, cfg: Any, comm: Collectives, device: torch.device | str) -> None:
        from slipstream.config import DeepseekConfig

        self.comm = comm
        self.cfg = cfg
        self.device = torch.device(device)
        self.family = "deepseek" if isinstance(cfg, DeepseekConfig) else "llama"
        self.experts = (0, 0)

    def _place_llama(self, local: Any, vocab_lo: int) -> None:
        if self.device.type != "cpu":
            local.to(self.device, torch.bfloat16)   # norms, RoPE and the residual stream stay float32
        self.local = _parallelize(local, vocab_lo, self.comm)

    def _shard_deepseek(self, model: Any) -> None:
        if self.device.type != "cpu":
            raise SlipstreamError("tensor parallelism runs the DeepSeek/GLM family on the CPU (gloo) only; "
                                  "set SLIPSTREAM_TP_DEVICE=cpu")
        self.local, self.embed, self.head, self.experts = _shard_deepseek(model, self.comm.world, self.comm.rank)

    @torch.inference_mode()
    def forward(self, step: StepInput, kv: Any) -> torch.Tensor:
        if self.family == "llama":
            return self.local.forward(step, kv)
        return _deepseek_forward(self.local, self.embed, self.head, self.experts, self.comm, step, kv)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache | LatentKVCache:
        return self.local.new_kv_cache(num_blocks, block_size)

    def kv_bytes_per_token(self) -> int:
        return self.local.kv_bytes_per_token()


class TensorParallelModel:
    """Rank 0's shard behind the `Model` protocol: the engine drives it as one model; every call
    that the other ranks must mirror (a new KV cache, a step) is broadcast to them first."""

    def __init__(self, shard: ShardedModel):
        self.shard = shard
        self.cfg = shard.cfg
        self.device = shard.device
        self.devices: tuple[str, ...] = (shard.device.type,)
        self.world = shard.comm.world

    def forward(self, step: StepInput, kv: Any, return_hidden: bool = False) -> torch.Tensor:
        if return_hidden:
            raise SlipstreamError("tensor parallelism does not return hidden states (no MTP speculation)")
        # Gemma's hybrid cache: where each block's sliding-layer part is lives in rank 0's bookkeeping
        # (the scheduler's); the other ranks' caches take its block -> part map with the step
        parts = kv.local_of if isinstance(kv, HybridKVCache) else None
        self.shard.comm.broadcast(("step", step, parts))
        return self.shard.forward(step, kv)

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache | LatentKVCache:
        self.shard.comm.broadcast(("kv", num_blocks, block_size))
        return self.shard.new_kv_cache(num_blocks, block_size)

    def kv_bytes_per_token(self) -> int:
        return self.shard.kv_bytes_per_token()

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> Model:
        """The shards were placed when they were cut (rank r on cuda:r, or all on the CPU)."""
        if torch.device(device).type != self.device.type:
            raise SlipstreamError(f"this tensor-parallel model lives on {self.device.type} "
                                  f"(SLIPSTREAM_TP_DEVICE), not {torch.device(device).type}")
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
            if msg[2] is not None:
                kv.local_of.copy_(msg[2])
            shard.forward(msg[1], kv)
