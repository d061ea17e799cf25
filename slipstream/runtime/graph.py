"""The whole-step CUDA-graph runtime: the Triton decode step over static buffers, captured once
per (batch, context) bucket (`buckets.py`) and replayed every step.

A captured step runs embedding -> every layer -> final norm -> LM head -> greedy token selection
with no host synchronisation inside: token ids, positions, write slots, block tables and context
lengths live in fixed device buffers that are filled before the replay; the attention grid is sized
by the bucket's maximum context, not by this step's. A batch smaller than its bucket is padded with
rows whose write slot is -1 (the RoPE/KV-append kernel stores nothing for them) and whose context is
one token; rows are independent, so padding never changes a real row's result.

Without CUDA (`capture=False`) the same body runs uncaptured (under Triton's interpreter on a CPU),
which is how the tests check it against the eager step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slipstream.kernels.triton.configs import KernelConfigs, decode_shapes
from slipstream.kv.blocks import PagedKVCache, block_ids
from slipstream.models.llama import LlamaModel
from slipstream.runtime.buckets import BucketedDecoder
from slipstream.step import StepInput
from slipstream.weights.quant import Q8_0, Linear

MAX_ROWS = 16   # the largest batch bucket: [rows, tile, K-chunk] products past it spill registers


WeightArgs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def weight_args(w: Linear) -> WeightArgs:
    """The matvec kernel's view of a weight: dense, int8 + scales, or int4 nibbles + scales and mins
    (the packed layouts of `weights/quant.py` are the kernels' own)."""
    if not w.packed:
        return w.data, None, None
    if w.fmt == Q8_0:
        return w.data, w.scale, None
    return (w.data, *w.planes())   # Q4_K's planes made from its 6-bit form


@dataclass
class _Static:
    """Every tensor a captured step reads or writes: allocated once per bucket, never reallocated."""
    batch: int
    max_context: int            # the context bucket: sets the attention grid
    max_blocks: int
    tokens: torch.Tensor        # int64 [B]
    positions: torch.Tensor     # int64 [B]
    slots: torch.Tensor         # int64 [B], -1 on padded rows
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context: torch.Tensor       # int32 [B]
    x: torch.Tensor             # float32 [B, hidden]: the residual stream
    qkv: torch.Tensor
    q: torch.Tensor             # [B, H, D]
    attn: torch.Tensor          # [B, H, D]
    act: torch.Tensor           # SwiGLU output [B, intermediate]
    logits: torch.Tensor        # float32 [B, vocab]
    next_tokens: torch.Tensor   # int64 [B]: greedy choice, on the device
    attn_ws: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    matvec_ws: dict[tuple[int, int], torch.Tensor]
    matvec_locks: dict[tuple[int, int], torch.Tensor]
    graph: "torch.cuda.CUDAGraph | None" = None


class GraphDecoder(BucketedDecoder):
    """Decode steps of a Llama-family model as one replayed CUDA graph each (or, uncaptured, as a
    fixed sequence of Triton launches over static buffers), per (batch, context) bucket."""

    name = "graph"

    def __init__(self, model: LlamaModel, kv: PagedKVCache, max_batch: int = 8,
                 max_context: int | None = None, capture: bool | None = None,
                 configs: KernelConfigs | None = None):
        why = self.unsupported(model)
        if why:
            raise ValueError(why)
        self.model, self.kv = model, kv
        self.layers = [{k: weight_args(getattr(L, k)) for k in L.LINEARS} for L in model.layers]
        self.lm_head = weight_args(model.lm_head)
        self.device = kv.k.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA-graph capture needs the model and KV cache on a CUDA device")
        self._init_buckets(model, kv, max_batch, MAX_ROWS, max_context)
        self.configs = configs or KernelConfigs()

    @classmethod
    def unsupported(cls, model) -> str | None:
        """Why the Triton step cannot run this model (None: it can)."""
        if not isinstance(model, LlamaModel):
            return f"the graph runtime needs a Llama-family model, got {type(model).__name__}"
        c = model.cfg
        if c.head_dim & (c.head_dim - 1):
            return "the Triton decode step needs a power-of-two head_dim"
        if c.head_dim != 2 * model.inv_freq.numel():
            return "the Triton decode step rotates the whole head (no partial rotary)"
        return None

    # -- buffers and the captured body ---------------------------------------------------------
    def _alloc(self, B: int, C: int) -> _Static:
        c = self.model.cfg
        dev = self.device
        f32: dict[str, Any] = dict(dtype=torch.float32, device=dev)
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        part = self.configs.attention_for(B, C, KVH)["partition"]
        splits = -(-C // part)
        ws, locks = {}, {}
        for _, n, k in decode_shapes(c, [B]):
            p = self.configs.matvec_for(B, n, k)
            if p["split_k"] > 1:
                ws[(n, k)] = torch.empty((p["split_k"], B, n), **f32)
                # per N tile: how many of its split-K programs finished (the last one reduces)
                locks[(n, k)] = torch.zeros(-(-n // p["block_n"]), dtype=torch.int32, device=dev)
        s = _Static(
            batch=B, max_context=C, max_blocks=-(-C // self.kv.block_size),
            tokens=torch.zeros(B, dtype=torch.int64, device=dev),
            positions=torch.zeros(B, dtype=torch.int64, device=dev),
            slots=torch.full((B,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(B, -(-C // self.kv.block_size), dtype=torch.int32, device=dev),
            context=torch.ones(B, dtype=torch.int32, device=dev),
            x=torch.empty(B, c.hidden_size, **f32),
            qkv=torch.empty(B, (H + 2 * KVH) * D, **f32), q=torch.empty(B, H, D, **f32),
            attn=torch.empty(B, H, D, **f32), act=torch.empty(B, c.intermediate_size, **f32),
            logits=torch.empty(B, c.vocab_size, **f32),
            next_tokens=torch.zeros(B, dtype=torch.int64, device=dev),
            attn_ws=(torch.empty(B, H, splits, D, **f32), torch.empty(B, H, splits, **f32),
                     torch.empty(B, H, splits, **f32)),
            matvec_ws=ws, matvec_locks=locks)
        return s

    def _matvec(self, s: _Static, x: torch.Tensor, w: WeightArgs, out: torch.Tensor, accumulate: bool = False,
                norm: torch.Tensor | None = None, glu: bool = False) -> None:
        from slipstream.kernels.triton.matvec import matvec

        n, k = w[0].shape[0], x.shape[1]    # the weight's rows (gate and up together for SwiGLU)
        p = self.configs.matvec_for(s.batch, n, k)
        matvec(x, *w, out=out, accumulate=accumulate, block_n=p["block_n"], block_k=p["block_k"],
               split_k=p["split_k"], num_warps=p["num_warps"], workspace=s.matvec_ws.get((n, k)),
               locks=s.matvec_locks.get((n, k)), norm_weight=norm, eps=self.model.cfg.rms_norm_eps, glu=glu)

    def _body(self, s: _Static) -> None:
        """One decode step on the static buffers: only kernel launches, no host synchronisation.
        Six per layer: norm + QKV product, RoPE + KV append, attention (splits, merge), output
        product + residual, norm + gate/up product + SwiGLU, down product + residual."""
        from slipstream.kernels.triton.attention import paged_decode_attention
        from slipstream.kernels.triton.rope import rope_kv_append
        from slipstream.kernels.triton.sample import greedy

        m, c = self.model, self.model.cfg
        H, KVH, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        B = s.batch
        att = self.configs.attention_for(B, s.max_context, KVH)
        s.x.copy_(m.embed.dequantize(s.tokens))
        for li, (L, Wl) in enumerate(zip(m.layers, self.layers)):
            self._matvec(s, s.x, Wl["qkv"], s.qkv, norm=L.attn_norm)
            if L.qkv.bias is not None:    # Qwen2's q/k/v biases (in place: capture-safe)
                s.qkv.add_(L.qkv.bias)
            rope_kv_append(s.qkv, s.positions, m.inv_freq, s.slots, self.kv.k[li], self.kv.v[li],
                           H, KVH, D, q_out=s.q, q_norm=L.q_norm, k_norm=L.k_norm, eps=eps)
            paged_decode_attention(s.q, self.kv.k[li], self.kv.v[li], s.block_tables, s.context,
                                   s.max_context, block_size=self.kv.block_size,
                                   partition=att["partition"], block_n=att["block_n"], out=s.attn,
                                   workspace=s.attn_ws)
            self._matvec(s, s.attn.view(B, H * D), Wl["o"], s.x, accumulate=True)
            self._matvec(s, s.x, Wl["gate_up"], s.act, norm=L.ffn_norm, glu=True)
            self._matvec(s, s.act, Wl["down"], s.x, accumulate=True)
        self._matvec(s, s.x, self.lm_head, s.logits, norm=m.norm)
        greedy(s.logits, out=s.next_tokens)

    def _capture(self, s: _Static) -> None:
        """Warm up (compiles every kernel) on a side stream, then record the step into a graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._body(s)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._body(s)
        s.graph = graph

    def _build(self, B: int, C: int) -> _Static:
        """A bucket's buffers and, on CUDA, its captured graph."""
        s = self._alloc(B, C)
        if self.capture:
            self._capture(s)
        return s

    def capture_all(self, up_to_context: int | None = None) -> None:
        """Captures the buckets now (start-up) so that requests do not pay for captures; those of
        longer contexts than `up_to_context` stay lazy (rarer, and their buffers are larger)."""
        for b in self.buckets:
            for c in self.context_buckets:
                if up_to_context is None or c <= up_to_context or c == self.context_buckets[0]:
                    self.static(b, c)

    def replay(self, s: _Static) -> None:
        if s.graph is not None:
            s.graph.replay()
        else:
            self._body(s)

    # -- the engine's interface (forward: `BucketedDecoder`) -----------------------------------
    def fill(self, s: _Static, step: StepInput) -> None:
        """Copies one step's inputs into the bucket's buffers; rows past the batch become padding."""
        n = step.token_ids.shape[0]
        ctx = [q.context for q in step.seqs]
        if max(ctx) > s.max_context:
            raise ValueError(f"context {max(ctx)} exceeds the bucket's maximum {s.max_context}")
        tables = torch.zeros(s.batch, s.max_blocks, dtype=torch.int32)
        for i, q in enumerate(step.seqs):
            ids = block_ids(q.read, self.kv.block_size)[:s.max_blocks]
            tables[i, :ids.numel()] = ids
        pad = s.batch - n
        tokens = torch.cat([step.token_ids.long().cpu(), torch.zeros(pad, dtype=torch.int64)])
        positions = torch.cat([step.positions.long().cpu(), torch.zeros(pad, dtype=torch.int64)])
        slots = torch.cat([step.write_slots.long().cpu(), torch.full((pad,), -1, dtype=torch.int64)])
        context = torch.tensor(ctx + [1] * pad, dtype=torch.int32)
        for dst, src in ((s.tokens, tokens), (s.positions, positions), (s.slots, slots),
                         (s.block_tables, tables), (s.context, context)):
            dst.copy_(src, non_blocking=True)

    @staticmethod
    def logits_of(s: _Static) -> torch.Tensor:
        return s.logits


def meta_decoder(cfg, batch: int, context: int, dtype: torch.dtype = torch.bfloat16,
                 configs: KernelConfigs | None = None) -> tuple[GraphDecoder, _Static]:
    """A GraphDecoder over "meta" weights and KV cache (shapes and dtypes, no storage) and one bucket's
    buffers: running its `_body` inside `kernels.triton.offline.record()` lists the launches a captured
    step holds (offline compilation, the GPU latency model, the launch-count test), without a GPU."""
    from slipstream.models.llama import LlamaModel
    from slipstream.weights.layers import LlamaLayer

    H, KVH, D, Hd, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size

    def mat(n: int, k: int) -> Linear:
        return Linear(n, k, torch.empty(n, k, dtype=dtype, device="meta"))

    def vec(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32, device="meta")
    weights: dict[str, Any] = {"embed": mat(cfg.vocab_size, Hd), "norm": vec(Hd)}
    weights["lm_head"] = weights["embed"] if cfg.tie_word_embeddings else mat(cfg.vocab_size, Hd)
    for i in range(cfg.num_layers):
        weights[f"layers.{i}"] = LlamaLayer(attn_norm=vec(Hd), ffn_norm=vec(Hd), qkv=mat((H + 2 * KVH) * D, Hd),
                                            o=mat(Hd, H * D), gate_up=mat(2 * F, Hd), down=mat(Hd, F))
    model = LlamaModel(cfg, weights)
    model.inv_freq = model.inv_freq.to("meta")
    model.device, model.kv_dtype = torch.device("meta"), dtype
    blocks = -(-context // 16) * batch
    kv = PagedKVCache(cfg.num_layers, blocks, 16, KVH, D, dtype=dtype, device="meta")
    dec = GraphDecoder(model, kv, max_batch=batch, max_context=context, capture=False, configs=configs)
    return dec, dec._alloc(batch, context)
