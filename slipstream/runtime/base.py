"""The `Decoder` protocol: one forward step of a model over its KV cache, however it executes.

Every runtime (eager, native CPU, CUDA graph, megakernel, and the ones to come) is a class with

    name: str                     the name users pick it by (`--runtime NAME`, the registry's key)
    device_greedy: bool           forward(step, tokens_only=True) is supported: greedy tokens chosen
                                  where the logits are (no [rows, vocab] copy to the host)
    unsupported(model) -> str | None    classmethod: why this runtime cannot run `model` (None: it can)
    forward(step, tokens_only=False) -> torch.Tensor
        the float32 logits of `step.logits_rows` on the CPU; with `tokens_only` (only where
        `device_greedy`) their greedy tokens instead, int64 on the CPU

A runtime may also offer `forward_rows(rows: DecodeRows, tokens_only=False) -> torch.Tensor | list[int]`,
`forward` of a decode step given as plain lists (`step.DecodeRows`; with `tokens_only` the greedy tokens
as a list): the engine then sends its plain decode steps there (not verification rows, not steps that carry
prompt chunks, not when an MTP proposer needs the hidden states), and a runtime on the host fills its
arrays in place instead of reading tensors built for it.

A runtime may also declare `prefill_tokens: int`, the most prompt tokens (rows of several tokens per
sequence, attending causally) one forward takes; without it, prefill runs on the eager step.

built by `runtime.registry.build_decoder`, which passes the engine configuration's options
(`DecoderOptions`). A runtime never moves the model: placement (`Model.to`) is a separate step
(`runtime.registry.placement`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from slipstream.step import StepInput


@runtime_checkable
class Decoder(Protocol):
    name: ClassVar[str]
    device_greedy: ClassVar[bool]

    @classmethod
    def unsupported(cls, model: Any) -> str | None: ...

    def forward(self, step: StepInput, tokens_only: bool = False) -> torch.Tensor: ...


@dataclass(frozen=True)
class DecoderOptions:
    """What a runtime's constructor may use besides the model and its KV cache."""
    max_rows: int = 8                 # most rows one decode step holds (K + 1 per sequence when speculating)
    max_context: int | None = None    # longest context a step attends over
    hints: dict[str, Any] = field(default_factory=dict)   # a compiled artifact's kernel configs and plans
    exact: bool = False               # CPU: exact fp32-activation kernels instead of the int8-activation path
    threads: int | None = None        # CPU: the native team's threads (None: one per core)


class EagerDecoder:
    """The model's own torch step (the reference every other runtime is tested against)."""

    name: ClassVar[str] = "eager"
    device_greedy: ClassVar[bool] = False

    def __init__(self, model: Any, kv: Any):
        self.model, self.kv = model, kv

    @classmethod
    def unsupported(cls, model: Any) -> str | None:
        return None

    def forward(self, step: StepInput, tokens_only: bool = False) -> torch.Tensor:
        if tokens_only:
            raise ValueError("the eager runtime returns logits (device_greedy is False)")
        return self.model.forward(step, self.kv).cpu()   # sampling runs on the host
