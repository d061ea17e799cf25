"""Model definitions, one per family; `build_model` picks the class for a loaded config."""
from __future__ import annotations

from typing import Any


def build_model(config: Any, weights: dict[str, Any]):
    """The model object for `config`: a DeepseekConfig -> DeepseekModel; a ModelConfig -> QwenMoeModel
    when it has experts, EagerDecoderModel when it has other features only the eager step computes
    (`ModelConfig.eager_only()`), else LlamaModel (what the fast runtimes run)."""
    from slipstream.config import DeepseekConfig

    if isinstance(config, DeepseekConfig):
        from slipstream.models.deepseek import DeepseekModel
        return DeepseekModel(config, weights)
    if getattr(config, "num_experts", 0):
        from slipstream.models.qwen_moe import QwenMoeModel
        return QwenMoeModel(config, weights)
    from slipstream.models.llama import EagerDecoderModel, LlamaModel
    if config.eager_only() is not None and config.architecture != "gemma3":   # the registry refuses Gemma 3 by name
        return EagerDecoderModel(config, weights)
    return LlamaModel(config, weights)
