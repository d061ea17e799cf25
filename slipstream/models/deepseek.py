"""DeepSeek-V3 / V3.2, GLM-4.5 and GLM-5 in plain torch over a paged KV cache.

The same step interface as `slipstream.models.llama.LlamaModel` (a `slipstream.step.StepInput` of flattened tokens,
per-sequence `SeqSlice`s, logits for `logits_rows`), so the engine drives either unchanged.

Attention:
  * MLA (DeepSeek, GLM-5). Per token the cache holds only the normalised KV latent c (kv_lora_rank)
    and the shared rotary key k_pe (qk_rope_head_dim). A head's key is [W_uk c ; k_pe] and its value
    W_uv c, with W_uk / W_uv the two row blocks of kv_b_proj. Two equal ways to attend:
      naive     expand the context's latents into per-head keys and values (prefill: many queries);
      absorbed  fold W_uk into the query (q_nope W_uk, a kv_lora_rank vector per head), score it
                against the latents directly, average the latents and only then apply W_uv
                (decode: one query per sequence, no per-token expansion of the context).
    DeepSeek Sparse Attention (V3.2, GLM-5) adds the lightning indexer: its own multi-head query from
    the q latent, one LayerNorm'd key head (cached beside the latent), per-head weights from the
    hidden state, ReLU'd dot products summed over heads; each query then attends only to its
    top-`index_topk` context tokens. GLM-5's "shared" layers reuse the previous full layer's choice.
  * GQA (GLM-4.5): Llama-like heads with q/k/v biases, optional per-head q/k RMSNorm and RoPE on the
    leading `partial_rotary_factor` share of each head.
RoPE: DeepSeek lays the rotary dimensions out as (x0, x1), (x2, x3), ... pairs; GLM-4.5 and the
V3.2 indexer as halves. YaRN scaling as in the YaRN paper, with DeepSeek's softmax-scale correction
mscale(factor, mscale_all_dim)^2.
MoE: sigmoid router; `e_score_correction_bias` steers which experts are chosen but not their weights;
experts are chosen within the `topk_group` best of `n_group` groups (a group scores the sum of its two
best); weights renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`; shared experts
always run; the first `first_k_dense_replace` layers are dense.
MTP (`num_nextn_predict_layers`): `mtp_forward` runs one next-n prediction layer, with its own KV in
the cache layers after the main ones, for speculative decoding to drive.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from slipstream.config import DeepseekConfig
from slipstream.errors import ModelLoadError
from slipstream.kv.blocks import LatentKVCache, PagedKVCache
from slipstream.step import SeqSlice, StepInput
from slipstream.weights.deepseek import (
    DeepseekLayer,
    DeepseekMoe,
    DenseMlp,
    GqaAttention,
    Indexer,
    MlaAttention,
    MtpLayer,
)

LATENT_NORM_EPS = 1e-6   # q_a_layernorm / kv_a_layernorm use a fixed eps, not rms_norm_eps
INDEXER_NORM_EPS = 1e-6


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_parameters(cfg: DeepseekConfig) -> tuple[torch.Tensor, float, float]:
    """(inverse frequencies over the rotary dims, cos/sin amplitude, softmax-scale multiplier)."""
    dim, theta = cfg.rope_dim, cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if not rs:
        return inv, 1.0, 1.0
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "linear":
        return inv / float(rs["factor"]), 1.0, 1.0
    if kind != "yarn":
        raise ModelLoadError(f"unsupported rope scaling {kind!r} for {cfg.architecture}")
    orig = float(rs["original_max_position_embeddings"])
    factor = rs.get("factor")
    factor = float(factor) if factor is not None else cfg.max_position_embeddings / orig
    amp = rs.get("attention_factor")
    m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if amp is None:
        amp = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)
    fast, slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_of(turns: float) -> float:  # the dim index whose wave turns `turns` times over `orig`
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(fast), dim_of(slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    # 0: fast dims kept as they are (extrapolated), 1: slow dims interpolated (divided by factor)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    inv = inv * (1 - ramp) + inv / factor * ramp
    softmax_mult = 1.0
    if cfg.attention == "mla" and m_all:
        softmax_mult = _mscale(factor, m_all) ** 2
    return inv, float(amp), softmax_mult


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE over all of x's last dim; cos/sin [T, d/2] broadcast over the middle (head) dims.
    Interleaved pairs (x0, x1), (x2, x3), ... or halves (x_i, x_{i+d/2}); the result lists the pairs'
    first members then their second members (a fixed permutation, the same for queries and keys)."""
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
    while cos.dim() < a.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def _read(t: torch.Tensor, s: SeqSlice) -> torch.Tensor:
    if isinstance(s.read, tuple):
        return t[s.read[0]:s.read[1]]
    return t.index_select(0, s.read)


def _causal(s: SeqSlice) -> torch.Tensor | None:
    """[length, context] bool: query i sees keys up to context - length + i (None: sees all)."""
    if s.length == 1:
        return None
    i = torch.arange(s.length)[:, None]
    j = torch.arange(s.context)[None, :]
    return j <= (s.context - s.length + i)


class DeepseekModel:
    """`weights`: "embed", "lm_head", "norm" (float32 tensors), "layers.{i}" a typed
    `weights.deepseek.DeepseekLayer` per layer and "mtp.{j}" a `MtpLayer` per loaded MTP layer, as
    `weights.safetensors` writes them."""
    devices = ("cpu",)            # float32 on the CPU for now
    device = torch.device("cpu")

    def __init__(self, cfg: DeepseekConfig, weights: dict[str, Any]):
        self.cfg = cfg
        self.embed: torch.Tensor = weights["embed"]
        self.lm_head: torch.Tensor = weights["lm_head"]
        self.norm: torch.Tensor = weights["norm"]
        self.layers: list[DeepseekLayer] = [weights[f"layers.{i}"] for i in range(cfg.num_layers)]
        self.mtp: list[MtpLayer] = []
        for j in range(cfg.num_nextn_predict_layers):
            m = weights.get(f"mtp.{j}")
            if m is None:
                break
            self.mtp.append(m)
        self.inv_freq, self.rope_amp, softmax_mult = rope_parameters(cfg)
        if cfg.attention == "mla":
            self.scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * softmax_mult
        else:
            self.scale = cfg.head_dim ** -0.5
        # "auto": absorbed form for single-token (decode) rows, expanded keys/values for prefill
        self.mla_mode = "auto"

    # -- cache --------------------------------------------------------------------------------
    @property
    def num_cache_layers(self) -> int:
        return self.cfg.num_layers + len(self.mtp)

    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        if c.attention == "mla":
            per_layer = c.kv_lora_rank + c.qk_rope_head_dim + (c.index_head_dim if c.dsa else 0)
        else:
            per_layer = 2 * c.num_kv_heads * c.head_dim
        return self.num_cache_layers * per_layer * 4

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> LatentKVCache | PagedKVCache:
        c = self.cfg
        if c.attention == "mla":
            return LatentKVCache(self.num_cache_layers, num_blocks, block_size, c.kv_lora_rank,
                                 c.qk_rope_head_dim, c.index_head_dim if c.dsa else 0)
        return PagedKVCache(self.num_cache_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> DeepseekModel:
        """Placement: the DeepSeek family runs on the CPU only (for now)."""
        if torch.device(device).type not in self.devices:
            raise ModelLoadError(f"the {self.cfg.architecture} family runs on the CPU only for now")
        return self

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.rope_amp, freqs.sin() * self.rope_amp

    # -- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, step: StepInput, kv, return_hidden: bool = False):
        """Logits [len(logits_rows), vocab]; with return_hidden also the final-normed hidden state
        of every row [T, hidden] (what the first MTP layer takes)."""
        c = self.cfg
        x = self.embed.index_select(0, step.token_ids)
        cos, sin = self._rope_tables(step.positions)
        shared_sel: list[torch.Tensor | None] | None = None
        for li, L in enumerate(self.layers):
            x, shared_sel = self._layer(li, L, x, step, kv, cos, sin, shared_sel)
        h = F.rms_norm(x, (c.hidden_size,), self.norm, c.rms_norm_eps)
        logits = _linear(h.index_select(0, step.logits_rows), self.lm_head)
        return (logits, h) if return_hidden else logits

    @torch.inference_mode()
    def mtp_forward(self, step: StepInput, kv, hidden: torch.Tensor, depth: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One next-n prediction layer (DeepSeek-V3 MTP). Row i of the step holds token t_{i+1} at
        position i and `hidden` [T, hidden] the state that predicted it (the main model's final-normed
        hidden state for depth 0, the previous MTP layer's output after that). Computes
            x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(hidden_i)]),  x = decoder_layer(x),
            logits = head(head_norm(x))
        with the layer's KV in cache layer num_layers + depth (same slots as the main model).
        Returns (logits of logits_rows, x for every row: the next depth's `hidden`)."""
        c = self.cfg
        if depth >= len(self.mtp):
            raise ValueError(f"the model has {len(self.mtp)} MTP layer(s) loaded, asked for depth {depth}")
        M = self.mtp[depth]
        embed = M.embed if M.embed is not None else self.embed
        head = M.head if M.head is not None else self.lm_head
        e = embed.index_select(0, step.token_ids)
        x = _linear(torch.cat([F.rms_norm(e, (c.hidden_size,), M.enorm, c.rms_norm_eps),
                               F.rms_norm(hidden, (c.hidden_size,), M.hnorm, c.rms_norm_eps)], -1),
                    M.eh_proj)
        cos, sin = self._rope_tables(step.positions)
        x, _ = self._layer(c.num_layers + depth, M, x, step, kv, cos, sin, None)
        h = F.rms_norm(x.index_select(0, step.logits_rows), (c.hidden_size,), M.head_norm,
                       c.rms_norm_eps)
        return _linear(h, head), x

    def _layer(self, li: int, L: DeepseekLayer, x: torch.Tensor, step: StepInput, kv, cos, sin, shared_sel):
        c = self.cfg
        h = F.rms_norm(x, (c.hidden_size,), L.attn_norm, c.rms_norm_eps)
        a, shared_sel = self.attention(li, L.attn, h, step, kv, cos, sin, shared_sel)
        x = x + a
        h = F.rms_norm(x, (c.hidden_size,), L.ffn_norm, c.rms_norm_eps)
        return x + self.ffn(L.ffn, h), shared_sel

    def attention(self, li: int, A: MlaAttention | GqaAttention, h: torch.Tensor, step: StepInput, kv, cos, sin,
                  shared_sel) -> tuple[torch.Tensor, list[torch.Tensor | None] | None]:
        """(the attention output of layer `li` before the residual, the DSA selections a following
        GLM-5 "shared" layer reuses)."""
        if isinstance(A, MlaAttention):
            return self._mla(li, A, h, step, kv, cos, sin, shared_sel)
        return self._gqa(li, A, h, step, kv, cos, sin), shared_sel

    def ffn(self, W: DenseMlp | DeepseekMoe, h: torch.Tensor) -> torch.Tensor:
        return self._moe(W, h) if isinstance(W, DeepseekMoe) else self._mlp(W, h)

    # -- attention ----------------------------------------------------------------------------
    def _gqa(self, li, L: GqaAttention, h, step: StepInput, kv: PagedKVCache, cos, sin) -> torch.Tensor:
        c = self.cfg
        T = h.shape[0]
        H, KVH, D, rd = c.num_heads, c.num_kv_heads, c.head_dim, c.rope_dim
        qkv = _linear(h, L.qkv, L.qkv_bias)
        q = qkv[:, :H * D].view(T, H, D)
        k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
        v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
        if c.qk_norm:
            q = F.rms_norm(q, (D,), L.q_norm, c.rms_norm_eps)
            k = F.rms_norm(k, (D,), L.k_norm, c.rms_norm_eps)
        q = torch.cat([rotate(q[..., :rd], cos, sin, False), q[..., rd:]], -1)
        k = torch.cat([rotate(k[..., :rd], cos, sin, False), k[..., rd:]], -1)
        kv.k[li].index_copy_(0, step.write_slots, k)
        kv.v[li].index_copy_(0, step.write_slots, v)
        outs = []
        for s in step.seqs:
            qs = q[s.start:s.start + s.length].transpose(0, 1)
            ks, vs = _read(kv.k[li], s).transpose(0, 1), _read(kv.v[li], s).transpose(0, 1)
            mask = _causal(s)
            # 4-D: torch's CPU flash kernel takes no 3-D inputs (llama.py's _attention)
            outs.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, scale=self.scale,
                                                       enable_gqa=KVH != H)[0].transpose(0, 1))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs)
        return _linear(attn.reshape(T, H * D), L.o, L.o_bias)

    def _mla(self, li, L: MlaAttention, h, step: StepInput, kv: LatentKVCache, cos, sin, shared_sel):
        c = self.cfg
        T = h.shape[0]
        H, dn, dr, r = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        if c.q_lora_rank is None:
            q_lat = None
            q = _linear(h, L.q)
        else:
            q_lat = F.rms_norm(_linear(h, L.q_a, L.q_a_bias), (c.q_lora_rank,), L.q_a_norm, LATENT_NORM_EPS)
            q = _linear(q_lat, L.q_b)
        q = q.view(T, H, dn + dr)
        q_nope, q_pe = q[..., :dn], rotate(q[..., dn:], cos, sin, c.rope_interleave)
        kva = _linear(h, L.kv_a, L.kv_a_bias)
        latent = F.rms_norm(kva[:, :r], (r,), L.kv_a_norm, LATENT_NORM_EPS)
        k_pe = rotate(kva[:, r:], cos, sin, c.rope_interleave)
        kv.latent[li].index_copy_(0, step.write_slots, latent)
        kv.rope[li].index_copy_(0, step.write_slots, k_pe)

        selections: list[torch.Tensor | None] | None = None
        if c.dsa:
            if L.indexer is not None:
                selections = self._index(li, L.indexer, h, q_lat, step, kv, cos, sin)
            else:  # GLM-5 "shared" layer: the previous full layer's choice
                selections = shared_sel
        outs = []
        for n, s in enumerate(step.seqs):
            rows = slice(s.start, s.start + s.length)
            lat, pe = _read(kv.latent[li], s), _read(kv.rope[li], s)
            mask = _causal(s)
            if selections is not None and selections[n] is not None:
                mask = selections[n] if mask is None else mask & selections[n]
            absorbed = self.mla_mode == "absorbed" or (self.mla_mode == "auto" and s.length == 1)
            attend = self._mla_absorbed if absorbed else self._mla_naive
            outs.append(attend(L, q_nope[rows], q_pe[rows], lat, pe, mask))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs)
        return _linear(attn.reshape(T, H * c.v_head_dim), L.o, L.o_bias), selections

    def _softmax(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        scores = scores * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1)

    def _mla_naive(self, L: MlaAttention, q_nope, q_pe, lat, pe, mask) -> torch.Tensor:
        """Expand the context's latents into per-head keys/values. [n, H, dv]."""
        k_nope = torch.einsum("cr,hdr->chd", lat, L.w_uk)
        v = torch.einsum("cr,hdr->chd", lat, L.w_uv)
        scores = torch.einsum("nhd,chd->hnc", q_nope, k_nope) + torch.einsum("nhd,cd->hnc", q_pe, pe)
        p = self._softmax(scores, mask)
        return torch.einsum("hnc,chd->nhd", p, v)

    def _mla_absorbed(self, L: MlaAttention, q_nope, q_pe, lat, pe, mask) -> torch.Tensor:
        """Attend in latent space: W_uk folded into the query, W_uv applied after. [n, H, dv]."""
        q_abs = torch.einsum("nhd,hdr->nhr", q_nope, L.w_uk)
        scores = torch.einsum("nhr,cr->hnc", q_abs, lat) + torch.einsum("nhd,cd->hnc", q_pe, pe)
        p = self._softmax(scores, mask)
        o_lat = torch.einsum("hnc,cr->nhr", p, lat)
        return torch.einsum("nhr,hdr->nhd", o_lat, L.w_uv)

    def _index(self, li, W: Indexer, h, q_lat, step: StepInput, kv: LatentKVCache, cos, sin
               ) -> list[torch.Tensor | None]:
        """The lightning indexer: per sequence a [length, context] bool of the tokens each query may
        attend to (its top index_topk by index score), or None where the context holds no more."""
        c = self.cfg
        T = h.shape[0]
        Hi, Di, dr = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
        il = c.index_rope_interleave
        k = F.layer_norm(_linear(h, W.wk), (Di,), W.k_norm, W.k_norm_bias, INDEXER_NORM_EPS)
        k = torch.cat([rotate(k[:, :dr], cos, sin, il), k[:, dr:]], -1)
        kv.index_k[li].index_copy_(0, step.write_slots, k)
        if all(s.context <= c.index_topk for s in step.seqs):
            return [None] * len(step.seqs)
        q = _linear(q_lat, W.wq_b).view(T, Hi, Di)
        q = torch.cat([rotate(q[..., :dr], cos, sin, il), q[..., dr:]], -1)
        head_w = _linear(h, W.weights_proj) * Hi ** -0.5
        out: list[torch.Tensor | None] = []
        for s in step.seqs:
            if s.context <= c.index_topk:
                out.append(None)
                continue
            rows = slice(s.start, s.start + s.length)
            keys = _read(kv.index_k[li], s)
            per_head = torch.relu(torch.einsum("nhd,cd->nhc", q[rows], keys) * Di ** -0.5)
            score = torch.einsum("nh,nhc->nc", head_w[rows], per_head)
            causal = _causal(s)
            if causal is not None:
                score = score.masked_fill(~causal, float("-inf"))
            top = score.topk(c.index_topk, dim=-1).indices
            out.append(torch.zeros(s.length, s.context, dtype=torch.bool).scatter_(1, top, True))
        return out

    # -- feed-forward -------------------------------------------------------------------------
    @staticmethod
    def _mlp(W: DenseMlp, h: torch.Tensor) -> torch.Tensor:
        gu = _linear(h, W.gate_up)
        f = gu.shape[-1] // 2
        return _linear(F.silu(gu[:, :f]) * gu[:, f:], W.down)

    def route(self, W: DeepseekMoe, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their weights [T, k]) for each row of h."""
        c = self.cfg
        T, E = h.shape[0], c.n_routed_experts
        scores = torch.sigmoid(_linear(h, W.router))
        choice = scores if W.correction_bias is None else scores + W.correction_bias
        if c.n_group > 1:
            grouped = choice.view(T, c.n_group, E // c.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros(T, c.n_group, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // c.n_group, dim=1), float("-inf"))
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, ids)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * c.routed_scaling_factor

    def _moe(self, W: DeepseekMoe, h: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(W, h)
        out = torch.zeros_like(h)
        f = W.gate_up.shape[1] // 2
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            gu = _linear(h.index_select(0, rows), W.gate_up[e])
            y = _linear(F.silu(gu[:, :f]) * gu[:, f:], W.down[e])
            out[rows] += y * weights[rows, slot, None]   # a row picks an expert at most once
        if W.shared is not None:
            out += self._mlp(W.shared, h)
        return out
