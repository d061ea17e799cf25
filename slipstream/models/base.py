"""The `Model` protocol: what the engine and the runtimes may ask of any model family.

    cfg                           the family's config (a `config.ModelConfig` or `config.DeepseekConfig`)
    devices                       device types the family runs on ("cpu", "cuda")
    device                        where its weights are now
    forward(step, kv, return_hidden=False)
        float32 logits of `step.logits_rows` [rows, vocab]; with `return_hidden` also
        (logits, the final-normed hidden state of every row [T, hidden])
    new_kv_cache(num_blocks, block_size)      a KV cache shaped for this model, on its device
    kv_bytes_per_token()                      bytes one token takes in that cache
    to(device, dtype)                         placement: move the weights (a separate step from
                                              choosing a runtime; see runtime/registry.py)

Implemented by `models.llama.LlamaModel` (the dense Llama family, Gemma 2/3 and Phi-3 included),
`models.qwen_moe.QwenMoeModel` (Qwen2/3-MoE) and `models.deepseek.DeepseekModel`;
`models.build_model` picks the class for a loaded config.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from slipstream.kv.blocks import LatentKVCache, PagedKVCache
from slipstream.step import StepInput


@runtime_checkable
class Model(Protocol):
    cfg: Any
    devices: tuple[str, ...]
    device: torch.device

    def forward(self, step: StepInput, kv: Any, return_hidden: bool = False) -> Any: ...

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache | LatentKVCache: ...

    def kv_bytes_per_token(self) -> int: ...

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> Model: ...
