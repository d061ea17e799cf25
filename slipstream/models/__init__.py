"""Model definitions, one per family; `build_model` picks the class for a loaded config."""
from __future__ import annotations

from typing import Any


def build_model(config: Any, weights: dict[str, Any]):
    """The model object for `config`: a DeepseekConfig -> DeepseekModel; a ModelConfig -> QwenMoeModel
    when it has experts, else LlamaModel (each runtime refuses the features it does not compute:
    `runtime.registry.unsupported`)."""
    from slipstream.config import DeepseekConfig

    if isinstance(config, DeepseekConfig):
        from slipstream.models.deepseek import DeepseekModel
        return DeepseekModel(config, weights)
    if getattr(config, "num_experts", 0):
        from slipstream.models.qwen_moe import QwenMoeModel
        return QwenMoeModel(config, weights)
    from slipstream.models.llama import LlamaModel
    return LlamaModel(config, weights)
