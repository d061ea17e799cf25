"""Runtimes by name: one registry, the `auto` choice, and where the model must live.

  eager       the model's own torch step (the reference); on a GPU when there is one
  native      the CPU step over the native C kernels (packed GGUF weights)
  graph       the Triton step captured as one CUDA graph per batch bucket (GPU)
  megakernel  the whole step as one persistent Triton kernel running a compiled task plan (GPU)
  auto        graph on a GPU, else native where it applies, else eager

graph and megakernel also run on a CPU when TRITON_INTERPRET=1 is set (Triton's interpreter: slow,
for tests). Prefill runs on the eager step, except small chunks on a runtime that takes them
(`prefill_capacity`).

Three separate steps, in this order: `resolve_runtime` (which runtime a name stands for with this model
on this machine), `placement` (the device the model's weights must be on for it; the caller moves them
with `Model.to`), `build_decoder` (the `Decoder`, over the placed model and its KV cache).
This module imports no torch at import time: the CLI lists `RUNTIMES` from it.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from slipstream.errors import SlipstreamError

if TYPE_CHECKING:
    from slipstream.runtime.base import Decoder, DecoderOptions


@dataclass(frozen=True)
class RuntimeSpec:
    name: str
    target: str          # "module:Class" of the Decoder, imported on first use
    gpu: bool            # needs a CUDA GPU (or Triton's interpreter)
    build: Callable[[Any, Any, Any, DecoderOptions], Decoder]   # (class, model, kv, options) -> decoder

    def load(self) -> Any:
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)


def _plain(cls: Any, model: Any, kv: Any, o: DecoderOptions) -> Decoder:
    return cls(model, kv)


def _cpu(cls: Any, model: Any, kv: Any, o: DecoderOptions) -> Decoder:
    return cls(model, kv, exact=o.exact, threads=o.threads)


def _graph(cls: Any, model: Any, kv: Any, o: DecoderOptions) -> Decoder:
    dec = cls(model, kv, max_batch=o.max_rows, max_context=o.max_context, configs=o.hints.get("kernel_configs"))
    if dec.capture:   # the common short-context buckets at start-up, not on a first request
        dec.capture_all(up_to_context=2048)
    return dec


def _megakernel(cls: Any, model: Any, kv: Any, o: DecoderOptions) -> Decoder:
    return cls(model, kv, max_batch=o.max_rows, max_context=o.max_context,
               plans=o.hints.get("plans"))


REGISTRY: dict[str, RuntimeSpec] = {}


def register(spec: RuntimeSpec) -> None:
    """Add (or replace) a runtime; `auto` still picks among graph, native and eager."""
    REGISTRY[spec.name] = spec


for _spec in (RuntimeSpec("eager", "slipstream.runtime.base:EagerDecoder", False, _plain),
              RuntimeSpec("native", "slipstream.runtime.cpu_team:CpuTeamDecoder", False, _cpu),
              RuntimeSpec("graph", "slipstream.runtime.graph:GraphDecoder", True, _graph),
              RuntimeSpec("megakernel", "slipstream.runtime.megakernel:MegakernelDecoder", True, _megakernel)):
    register(_spec)

RUNTIMES = ("auto", *REGISTRY)


def runtime_names() -> tuple[str, ...]:
    return ("auto", *REGISTRY)


def decoder_class(name: str) -> Any:
    """The Decoder class registered as `name` (SlipstreamError when its module cannot be imported)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown runtime {name!r} ({', '.join(runtime_names())})")
    try:
        return REGISTRY[name].load()
    except ImportError as e:
        raise SlipstreamError(f"the {name} runtime is not available here ({e.name or e} is missing)") from None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _gpu_capable(model: Any) -> bool:
    return "cuda" in getattr(model, "devices", ("cpu",))


def unsupported(name: str, model: Any) -> str | None:
    """Why runtime `name` cannot run `model` on this machine (None: it can)."""
    spec = REGISTRY[name]
    cfg = getattr(model, "cfg", None)
    extras = cfg.eager_only() if spec.gpu and hasattr(cfg, "eager_only") else None
    if extras is not None:   # the GPU steps compute a plain Llama-family step only
        return f"the {name} runtime does not compute {extras}; the eager runtime does"
    try:
        why = decoder_class(name).unsupported(model)
    except SlipstreamError as e:
        return str(e)
    if why is None and spec.gpu and not ((_cuda() and _gpu_capable(model)) or _interpreted()):
        why = (f"the {name} runtime needs a CUDA GPU (or TRITON_INTERPRET=1 to run its kernels under "
               "Triton's interpreter, slowly)")
    return why


def resolve_runtime(name: str, model: Any) -> str:
    """The runtime `name` stands for with this model on this machine ("auto": graph on a GPU, else
    native where it applies, else eager); SlipstreamError when a named one cannot run it. Moves nothing."""
    if name == "auto":
        order = ["graph"] if _cuda() and _gpu_capable(model) else []
        for cand in order + ["native", "eager"]:
            if unsupported(cand, model) is None:
                return cand
        return "eager"
    if name not in REGISTRY:
        raise ValueError(f"unknown runtime {name!r} ({', '.join(runtime_names())})")
    why = unsupported(name, model)
    if why is not None:
        raise SlipstreamError(f"{why}; use --runtime auto")
    return name


def placement(name: str, model: Any) -> str:
    """The device type the model's weights must be on for runtime `name`: a CUDA GPU when there is one
    and the runtime and the model can use it, else the CPU."""
    if REGISTRY[name].gpu or name == "eager":
        return "cuda" if _cuda() and _gpu_capable(model) else "cpu"
    return "cpu"


def kv_cache_dtype(setting: str, name: str, model: Any, exact: bool = False) -> Any:
    """The KV cache's element type (a torch dtype) for runtime `name` over `model` with the engine's
    `kv_cache_dtype` setting, or None to keep the model's own (`model.kv_dtype`: the weights' on a GPU).
    "auto": fp16 under the native runtime's fast path (half the bytes attention reads, twice the tokens
    per byte of cache), fp32 under its exact path and the eager CPU step (the references); a GPU
    placement keeps the model's. "fp32"/"fp16": that type on the CPU; "int8": codes with a float32 scale
    per row (kv/blocks.py int8_rows; D + 4 bytes a row, about half of fp16's), not under the exact path;
    SlipstreamError on a GPU placement or for a model whose cache has no such choice (only the Llama
    family's `PagedKVCache` has one)."""
    import torch

    on_cpu = placement(name, model) == "cpu"
    if setting == "auto":
        if not on_cpu or not hasattr(model, "kv_dtype"):
            return None
        return torch.float16 if name == "native" and not exact else torch.float32
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}[setting]
    if not on_cpu or name not in ("native", "eager"):
        raise SlipstreamError(f"--kv-cache-dtype {setting} applies to the native and eager CPU runtimes; on a GPU "
                              "the KV cache takes the weights' dtype (use --kv-cache-dtype auto)")
    if not hasattr(model, "kv_dtype"):
        if dtype == torch.float32:
            return None
        raise SlipstreamError(f"this model's KV cache has no {setting} choice ({type(model).__name__}); "
                              "use --kv-cache-dtype auto")
    if dtype == torch.int8 and exact:
        raise SlipstreamError("--kv-cache-dtype int8 rounds K and V to 8 bits: the exact path keeps fp32 "
                              "(drop --exact, or use --kv-cache-dtype fp32)")
    return dtype


def kv_bytes_per_token(model: Any, dtype: Any = None) -> int:
    """Bytes one token takes in `model`'s KV cache of `dtype` elements (None: the model's own)."""
    return int(model.kv_bytes_per_token() if dtype is None else model.kv_bytes_per_token(dtype))


def new_kv_cache(model: Any, num_blocks: int, block_size: int, dtype: Any = None) -> Any:
    """`model`'s KV cache of `dtype` elements (None: the model's own; see `kv_cache_dtype`)."""
    if dtype is None:
        return model.new_kv_cache(num_blocks, block_size)
    return model.new_kv_cache(num_blocks, block_size, dtype=dtype)


def build_decoder(name: str, model: Any, kv: Any, options: DecoderOptions | None = None) -> Decoder:
    """The Decoder registered as `name`, over a model already placed (see `placement`)."""
    from slipstream.runtime.base import DecoderOptions

    spec = REGISTRY[name] if name in REGISTRY else None
    if spec is None:
        raise ValueError(f"unknown runtime {name!r} ({', '.join(runtime_names())})")
    try:
        return spec.build(decoder_class(name), model, kv, options or DecoderOptions())
    except ValueError as e:   # a model shape the kernels do not handle
        raise SlipstreamError(f"the {name} runtime cannot run this model: {e}") from None


def prefill_capacity(decoder: Any) -> int:
    """The most prompt tokens one `forward` of this decoder takes as a prefill step (chunks of several
    tokens per sequence); 0 for runtimes that run decode rows only (their prefill runs eagerly)."""
    return int(getattr(decoder, "prefill_tokens", 0))
