"""Model configuration, read from a Hugging Face config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slipstream.errors import ModelLoadError

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2", "gemma3_text", "gemma2", "phi3",
                "qwen2_moe", "qwen3_moe")
DEEPSEEK_FAMILY = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa")


@dataclass
class ModelConfig:
    architecture: str               # "llama" | "qwen2" | "qwen3" (mistral/smollm map to llama)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False    # Qwen2: biases on q/k/v
    qk_norm: bool = False           # Qwen3: RMSNorm on each head of q and k
    # Gemma 3 (architecture "gemma3"): GeGLU with tanh GELU, norms before and after attention and
    # MLP (the (1 + w) norm weights stored with the 1 added), the embedding scaled by sqrt(hidden),
    # attention scaled by query_pre_attn_scalar**-0.5, sliding-window layers with their own RoPE base
    hidden_act: str = "silu"        # "silu" | "gelu_tanh"
    embed_scale: float | None = None
    sandwich_norms: bool = False
    attn_scale: float | None = None   # None: head_dim**-0.5
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None   # "sliding" | "full" per layer
    rope_local_theta: float | None = None        # the sliding layers' RoPE base
    # Gemma 2: tanh soft-capping of the attention scores and of the final logits (cap * tanh(x / cap))
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Phi-3/4: RoPE over the first `rotary_dim` dims of each head only (None: the whole head);
    # LongRoPE is a `rope_scaling` of type "longrope" (short/long factors, attention factor)
    rotary_dim: int | None = None
    # Qwen2-MoE / Qwen3-MoE: softmax top-k routing over `num_experts` SwiGLU experts of
    # `moe_intermediate_size`; Qwen2-MoE adds a shared expert gated by a sigmoid; layers listed
    # False in `moe_layers` are dense (`intermediate_size`)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def _gemma3(cls, cfg: dict[str, Any]) -> "ModelConfig":
        return _gemma3_config(cfg, cls)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    @property
    def window_everywhere(self) -> int | None:
        """The sliding window when every layer has one (then a sequence's older blocks can be given
        back), else None (no window, or Gemma's mix of sliding and global layers)."""
        if not self.sliding_window or not self.layer_types:
            return None
        return self.sliding_window if all(t == "sliding" for t in self.layer_types) else None

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    @property
    def rope_dim(self) -> int:
        """Dimensions of each head that rotate (the leading ones)."""
        return self.rotary_dim or self.head_dim

    def eager_only(self) -> str | None:
        """The model and its features beyond a plain Llama-family step (None: Llama, Mistral, Qwen2/3,
        SmolLM2, Phi-3 without LongRoPE, partial rotary or a window), e.g. "Gemma 2 (logit
        soft-capping, ...)". The eager and native CPU steps compute them all; the GPU runtimes
        and tensor parallelism refuse a model that has any."""
        feats = []
        if self.num_experts:
            feats.append("mixture-of-experts layers")
        if self.attn_softcap or self.final_softcap:
            feats.append("logit soft-capping")
        if self.sandwich_norms:
            feats.append("norms after attention and MLP")
        if self.hidden_act != "silu":
            feats.append(f"{self.hidden_act} GLU")
        if self.embed_scale is not None:
            feats.append("a scaled embedding")
        if self.layer_types and "sliding" in self.layer_types:
            feats.append("sliding-window layers")
        if self.attn_scale is not None and abs(self.attn_scale - self.head_dim ** -0.5) > 1e-12:
            feats.append("an attention scale other than 1/sqrt(head_dim)")
        if self.rotary_dim is not None and self.rotary_dim != self.head_dim:
            feats.append("partial rotary embeddings")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        if kind not in (None, "default", "linear", "llama3"):
            feats.append(f"{kind} RoPE scaling")
        if not feats:
            return None
        name = FAMILY_NAMES.get(self.architecture, self.architecture)
        return f"{name} ({', '.join(feats)})"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        mt = cfg.get("model_type", "")
        if mt not in LLAMA_FAMILY:
            raise ModelLoadError(f"unsupported model_type {mt!r} in config.json "
                                 f"(supported: {', '.join(LLAMA_FAMILY + DEEPSEEK_FAMILY)})")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        scaling = cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers v5 folds theta and scaling in here
        if isinstance(params, dict):
            theta = params.get("rope_theta", theta)
            if params.get("rope_type", "default") != "default":
                scaling = params
        if mt == "gemma3_text":
            return cls._gemma3(cfg)
        if mt == "gemma2":
            return _gemma_config(cfg, cls, version=2)
        if mt == "phi3":
            return _phi3_config(cfg, cls)
        if mt in ("qwen2_moe", "qwen3_moe"):
            return _qwen_moe_config(cfg, cls)
        return cls(
            architecture={"qwen2": "qwen2", "qwen3": "qwen3"}.get(mt, "llama"),
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", mt == "qwen2")),
            qk_norm=(mt == "qwen3"),
        )


FAMILY_NAMES = {"gemma2": "Gemma 2", "gemma3": "Gemma 3", "phi3": "Phi-3", "qwen2moe": "Qwen2-MoE",
                "qwen3moe": "Qwen3-MoE"}


def _gemma3_config(cfg: dict[str, Any], cls: Any) -> "ModelConfig":
    return _gemma_config(cfg, cls, version=3)


def _gemma_config(cfg: dict[str, Any], cls: Any, version: int) -> "ModelConfig":
    """Gemma 2 and Gemma 3 (text): Gemma 2 has soft-capping, no q/k norms, one RoPE base and every
    other layer sliding; Gemma 3 q/k norms and its sliding layers' own RoPE base."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    params = cfg.get("rope_parameters")
    if version == 2:
        theta = (params or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or None
        local_theta = None
        if isinstance(params, dict) and params.get("rope_type", "default") != "default":
            scaling = params
    elif isinstance(params, dict) and "full_attention" in params:   # transformers v5: one dict per layer type
        full, local = params["full_attention"], params.get("sliding_attention", {})
        theta, local_theta = full.get("rope_theta", 1e6), local.get("rope_theta", 10000.0)
        scaling = full if full.get("rope_type", "default") != "default" else None
    else:
        theta, local_theta = cfg.get("rope_theta", 1e6), cfg.get("rope_local_base_freq", 10000.0)
        scaling = cfg.get("rope_scaling") or None
    n = cfg["num_hidden_layers"]
    period = 2 if version == 2 else cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
    if version == 3 and (cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping")):
        raise ModelLoadError("logit soft-capping in a Gemma 3 config is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"unsupported Gemma activation {act!r}")
    attn_cap, final_cap = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")
    return cls(
        architecture=f"gemma{version}", vocab_size=cfg["vocab_size"], hidden_size=hidden, num_layers=n,
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=version == 3, hidden_act="gelu_tanh",
        embed_scale=float(hidden) ** 0.5, sandwich_norms=True,
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        sliding_window=int(cfg.get("sliding_window") or 4096),
        layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types),
        rope_local_theta=None if local_theta is None else float(local_theta),
        attn_softcap=float(attn_cap) if attn_cap else None, final_softcap=float(final_cap) if final_cap else None)


def _phi3_config(cfg: dict[str, Any], cls: Any) -> "ModelConfig":
    """Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate/up (split at load), SiLU GLU, LongRoPE with
    short and long factors, RoPE over the leading `partial_rotary_factor` share of each head, and
    (as transformers computes it) every layer sliding when the config has a `sliding_window`."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    theta, scaling, rope = _rope_settings(cfg)
    head_dim = cfg.get("head_dim") or hidden // heads
    partial = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) or 1.0)
    n = cfg["num_hidden_layers"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported Phi-3 activation {cfg.get('hidden_act')!r}")
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in ("su", "yarn", "longrope"):
            scaling = dict(scaling, rope_type="longrope")
            scaling.setdefault("original_max_position_embeddings",
                               cfg.get("original_max_position_embeddings", max_pos))
    window = cfg.get("sliding_window")
    return cls(
        architecture="phi3", vocab_size=cfg["vocab_size"], hidden_size=hidden, num_layers=n, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
        sliding_window=int(window) if window else None,
        layer_types=("sliding",) * n if window else None)


def _qwen_moe_config(cfg: dict[str, Any], cls: Any) -> "ModelConfig":
    """Qwen1.5-MoE / Qwen2-MoE (shared expert behind a sigmoid gate, q/k/v biases) and Qwen3-MoE (q/k
    norms, no shared expert); dense layers where `mlp_only_layers` or `decoder_sparse_step` say."""
    mt = cfg["model_type"]
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    theta, scaling, _ = _rope_settings(cfg)
    n = cfg["num_hidden_layers"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported {mt} activation {cfg.get('hidden_act')!r}")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError(f"{mt}: sliding-window attention (use_sliding_window) is not supported")
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    qwen2 = mt == "qwen2_moe"
    return cls(
        architecture="qwen2moe" if qwen2 else "qwen3moe", vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=n, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("qkv_bias", True)) if qwen2 else bool(cfg.get("attention_bias", False)),
        qk_norm=not qwen2, num_experts=experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0) if qwen2 else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=tuple(i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(n)))


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, dict[str, Any]]:
    """(theta, scaling or None, the whole rope dict) from `rope_scaling`/`rope_theta` (v4) or
    `rope_parameters` (transformers v5, which folds theta, scaling and partial_rotary_factor in)."""
    scaling = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters")
    merged: dict[str, Any] = dict(scaling or {})
    if isinstance(params, dict):
        merged.update(params)
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling, merged


@dataclass
class DeepseekConfig:
    """DeepSeek-V3 / V3.2 and GLM-4.5 / GLM-5: MoE decoders with MLA (or, for GLM-4.5, GQA) attention
    and, for V3.2 / GLM-5, DeepSeek Sparse Attention. Field names follow Hugging Face's configs."""
    architecture: str               # the model_type: deepseek_v3 | deepseek_v32 | glm4_moe | glm_moe_dsa
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int          # dense layers' FFN
    moe_intermediate_size: int      # each routed / shared expert's FFN
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    mlp_layer_types: list[str] = field(default_factory=list)   # "dense" | "sparse" per layer
    # attention: "mla" (DeepSeek, GLM-5) or "gqa" (GLM-4.5)
    attention: str = "mla"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True    # MLA rotary dims as (x0, x1), (x2, x3), ... pairs
    num_kv_heads: int = 0           # GQA
    head_dim: int = 0               # GQA
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    qk_norm: bool = False           # GLM-4.5 use_qk_norm
    # DeepSeek Sparse Attention (lightning indexer)
    index_topk: int = 0             # 0: dense attention
    index_head_dim: int = 0
    index_n_heads: int = 0
    index_rope_interleave: bool = False   # GLM-5 interleaved, DeepSeek-V3.2 half-split
    indexer_types: list[str] = field(default_factory=list)    # "full" | "shared" per layer
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rope_dim(self) -> int:
        """Dimensions that rotate: MLA's decoupled key, or GQA's leading partial_rotary_factor share."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def dsa(self) -> bool:
        return self.index_topk > 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "DeepseekConfig":
        mt = cfg.get("model_type", "")
        if mt not in DEEPSEEK_FAMILY:
            raise ModelLoadError(f"unsupported model_type {mt!r} for the DeepSeek/GLM family")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
        try:
            theta, scaling, rope = _rope_settings(cfg)
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            n_dense = min(int(cfg.get("first_k_dense_replace") or 0), layers)
            mlp_types = cfg.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (layers - n_dense)
            dsa = mt in ("deepseek_v32", "glm_moe_dsa")
            out = cls(
                architecture=mt, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                num_layers=layers, num_heads=heads,
                intermediate_size=int(cfg["intermediate_size"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                n_routed_experts=int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0),
                n_shared_experts=int(cfg.get("n_shared_experts") or 0),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                mlp_layer_types=list(mlp_types),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers")
                                             or cfg.get("num_mtp_layers") or 0),
            )
            if mt == "glm4_moe":
                out.attention = "gqa"
                out.num_kv_heads = int(cfg.get("num_key_value_heads") or heads)
                out.head_dim = int(cfg.get("head_dim") or hidden // heads)
                out.partial_rotary_factor = float(cfg.get("partial_rotary_factor",
                                                          rope.get("partial_rotary_factor", 0.5)))
                out.qk_norm = bool(cfg.get("use_qk_norm", False))
            else:
                q_rank = cfg.get("q_lora_rank")
                out.q_lora_rank = int(q_rank) if q_rank else None
                out.kv_lora_rank = int(cfg["kv_lora_rank"])
                out.qk_nope_head_dim = int(cfg["qk_nope_head_dim"])
                out.qk_rope_head_dim = int(cfg["qk_rope_head_dim"])
                out.v_head_dim = int(cfg["v_head_dim"])
                # V3.2 and GLM-5 always lay the MLA rotary dims out in pairs
                out.rope_interleave = bool(cfg.get("rope_interleave", True)) if mt == "deepseek_v3" else True
            if dsa:
                if out.q_lora_rank is None:
                    raise ModelLoadError(f"{mt}: the DSA indexer needs q_lora_rank")
                out.index_topk = int(cfg.get("index_topk", 2048))
                out.index_head_dim = int(cfg.get("index_head_dim", 128))
                out.index_n_heads = int(cfg.get("index_n_heads", 64 if mt == "deepseek_v32" else 32))
                out.index_rope_interleave = mt == "glm_moe_dsa"
                types = cfg.get("indexer_types")
                if not types and mt == "glm_moe_dsa":
                    pattern = cfg.get("index_topk_pattern")
                    if pattern is not None:
                        types = [{"F": "full", "S": "shared"}[c] for c in pattern] \
                            if isinstance(pattern, str) else list(pattern)
                    else:
                        freq = max(int(cfg.get("index_topk_freq", 1)), 1)
                        offset = int(cfg.get("index_skip_topk_offset", 2))
                        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                                 for i in range(layers)]
                out.indexer_types = list(types or ["full"] * layers)
                if out.indexer_types[0] != "full":
                    raise ModelLoadError(f"{mt}: the first layer's indexer must be 'full'")
        except KeyError as e:
            raise ModelLoadError(f"config.json of a {mt} model lacks {e.args[0]!r}") from None
        if len(out.mlp_layer_types) != layers:
            raise ModelLoadError(f"{mt}: mlp_layer_types has {len(out.mlp_layer_types)} entries "
                                 f"for {layers} layers")
        if "sparse" in out.mlp_layer_types:
            per_group = out.n_routed_experts // out.n_group
            if out.n_routed_experts % out.n_group or (out.n_group > 1 and per_group < 2):
                raise ModelLoadError(f"{mt}: {out.n_routed_experts} experts do not split into "
                                     f"{out.n_group} groups of at least 2")
        return out


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig | DeepseekConfig:
    """The config class for a config.json's model_type."""
    if cfg.get("model_type", "") in DEEPSEEK_FAMILY:
        return DeepseekConfig.from_hf(cfg)
    return ModelConfig.from_hf(cfg)
