"""Model configuration, read from a Hugging Face config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slipstream.errors import ModelLoadError

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2")


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
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        mt = cfg.get("model_type", "")
        if mt not in LLAMA_FAMILY:
            raise ModelLoadError(f"unsupported model_type {mt!r} in config.json "
                                 f"(supported: {', '.join(LLAMA_FAMILY)})")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        scaling = cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers v5 folds theta and scaling in here
        if isinstance(params, dict):
            theta = params.get("rope_theta", theta)
            if params.get("rope_type", "default") != "default":
                scaling = params
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
