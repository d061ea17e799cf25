"""Which executor runs the decode step, and where the model lives.

  eager       the model's own torch step (the reference); on a GPU when there is one
  native      the CPU step over the native C kernels (packed GGUF weights)
  graph       the Triton step captured as one CUDA graph per batch bucket (GPU)
  megakernel  the whole step as one persistent Triton kernel running a compiled task plan (GPU)
  auto        graph on a GPU, else native where it applies, else eager

graph and megakernel also run on a CPU when TRITON_INTERPRET=1 is set (Triton's interpreter: slow,
for tests). Prefill always runs on the eager step.
"""
from __future__ import annotations

import os

import torch

from slipstream.errors import SlipstreamError
from slipstream.models.llama import LlamaModel

from slipstream.runtime import RUNTIMES


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_runtime(name: str, model, gpu_dtype: torch.dtype = torch.bfloat16) -> str:
    """The runtime `name` stands for with this model on this machine; moves a Llama-family model to
    the GPU (weights in `gpu_dtype`) when one is used."""
    from slipstream.runtime.cpu_native import NativeDecoder

    if name not in RUNTIMES:
        raise ValueError(f"unknown runtime {name!r} ({', '.join(RUNTIMES)})")
    cuda = torch.cuda.is_available() and isinstance(model, LlamaModel)
    if name == "native":
        if not NativeDecoder.supports(model):
            raise SlipstreamError("the native runtime needs packed GGUF weights (Q4_0/Q4_1/Q8_0/Q4_K) "
                                  "without q/k/v biases, and the native kernels; use --runtime auto or eager")
        return name
    if name == "auto":
        if cuda and _triton_ok() and _graph_runs(model):
            name = "graph"
        elif NativeDecoder.supports(model):
            return "native"
        else:
            name = "eager"
    if name in ("graph", "megakernel"):
        if not isinstance(model, LlamaModel) or not _triton_ok():
            raise SlipstreamError(f"the {name} runtime needs a Llama-family model and Triton")
        if not cuda and not _interpreted():
            raise SlipstreamError(f"the {name} runtime needs a CUDA GPU (or TRITON_INTERPRET=1 to run its "
                                  "kernels under Triton's interpreter, slowly); use --runtime auto")
    if cuda and model.device.type == "cpu":
        model.to("cuda", gpu_dtype)
    return name


def _graph_runs(model: LlamaModel) -> bool:
    from slipstream.runtime.graph import GraphDecoder
    return GraphDecoder.unsupported(model) is None


def build_runtime(kind: str, model, kv, max_rows: int, max_context: int, hints: dict | None = None):
    """The step executor for `kind` (None = the eager step); `hints` are a compiled artifact's kernel
    configurations and megakernel plans."""
    hints = hints or {}
    if kind == "eager":
        return None
    if kind == "native":
        from slipstream.runtime.cpu_native import NativeDecoder
        return NativeDecoder(model, kv)
    try:
        if kind == "graph":
            from slipstream.runtime.graph import GraphDecoder
            dec = GraphDecoder(model, kv, max_batch=max_rows, max_context=max_context,
                               configs=hints.get("kernel_configs"))
            if dec.capture:   # the common short-context buckets at start-up, not on a first request
                dec.capture_all(up_to_context=2048)
            return dec
        from slipstream.runtime.megakernel import MegakernelDecoder
        return MegakernelDecoder(model, kv, max_batch=max_rows, max_context=max_context,
                                 plans=hints.get("plans"))
    except ValueError as e:   # a model shape the kernels do not handle
        raise SlipstreamError(f"the {kind} runtime cannot run this model: {e}") from None
