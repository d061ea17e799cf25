"""`slipstream inspect MODEL`: what a model file is and how Slipstream will run it.

Architecture, parameter count, the tensor-type mix (how many tensors and bytes of each ggml or
safetensors type), context length, where the chat template comes from, and for every runtime
whether it can run the model here and why not; the runtime `auto` picks is marked. The model is
loaded as `generate` would load it, so load time and resident memory are real measurements.
"""
from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TypeShare:
    tensors: int = 0
    params: int = 0
    bytes: int = 0


@dataclass
class Report:
    path: str
    format: str                      # gguf | hf | artifact
    architecture: str
    parameters: int
    context_length: int
    file_bytes: int
    types: dict[str, TypeShare]      # storage type -> share
    chat_template: str               # where it comes from
    runtime: str                     # what --runtime auto runs
    runtimes: dict[str, str] = field(default_factory=dict)   # name -> "ok" or why not
    load_s: float = 0.0
    resident_bytes: int = 0          # process resident memory added by loading the model

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _gguf_types(path: Path) -> dict[str, TypeShare]:
    from slipstream.weights.gguf_file import GGUFFile

    out: dict[str, TypeShare] = collections.defaultdict(TypeShare)
    for t in GGUFFile(path).tensors:
        s = out[t.tensor_type.name]
        s.tensors += 1
        s.params += int(t.n_elements)
        s.bytes += int(t.n_bytes)
    return dict(out)


def _safetensors_types(folder: Path) -> dict[str, TypeShare]:
    from safetensors import safe_open

    out: dict[str, TypeShare] = collections.defaultdict(TypeShare)
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= int(d)
                s = out[str(sl.get_dtype())]
                s.tensors += 1
                s.params += n
    return dict(out)


def _template_source(path: Path, fmt: str, tokenizer: Any) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        return "none (chat requests are refused; raw prompts only)"
    if getattr(tokenizer, "chat_template_source", None):
        return str(tokenizer.chat_template_source)
    if fmt == "gguf":
        return "the file's tokenizer.chat_template"
    return "the folder's tokenizer_config.json / chat_template file"


def inspect_model(name: str | os.PathLike | None) -> Report:
    """Load `name` (a .gguf, a Hugging Face folder, an artifact, or None for the default model) and
    describe it."""
    import torch  # noqa: F401  (imported before the baseline: its own memory is not the model's)

    from slipstream.models import build_model
    from slipstream.runtime import registry
    from slipstream.weights import load_model, resolve_model
    from slipstream.weights.artifact import is_artifact

    path = resolve_model(name)
    fmt = "artifact" if is_artifact(path) else "gguf" if path.is_file() else "hf"
    before, t0 = _rss(), time.perf_counter()
    loaded = load_model(name)
    model = build_model(loaded.config, loaded.weights)
    load_s, resident = time.perf_counter() - t0, max(0, _rss() - before)
    if fmt == "gguf":
        types = _gguf_types(path)
        size = path.stat().st_size
    else:
        types = _safetensors_types(path) if fmt == "hf" else {}
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    cfg = loaded.config
    params = sum(s.params for s in types.values()) or _count_params(loaded.weights)
    runtimes = {}
    for rt in registry.REGISTRY:
        why = registry.unsupported(rt, model)
        runtimes[rt] = "ok" if why is None else why
    return Report(str(path), fmt, str(getattr(cfg, "architecture", type(cfg).__name__)), int(params),
                  int(getattr(cfg, "max_position_embeddings", 0)), int(size), types,
                  _template_source(path, fmt, loaded.tokenizer), registry.resolve_runtime("auto", model),
                  runtimes, load_s, resident)


def _count_params(weights: dict[str, Any]) -> int:
    import torch

    from slipstream.weights.quant import Linear

    total = 0
    for w in weights.values():
        items = [getattr(w, f) for f in getattr(w, "__dataclass_fields__", {})] if not isinstance(
            w, (Linear, torch.Tensor)) else [w]
        for x in items:
            if isinstance(x, Linear):
                total += x.n * x.k
            elif isinstance(x, torch.Tensor):
                total += x.numel()
    return total


def _human(n: float, unit: str = "B") -> str:
    for p in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or p == "T":
            return f"{n:.1f} {p}{unit}" if p else f"{n:.0f} {unit}"
        n /= 1000
    return f"{n} {unit}"


def render(r: Report) -> str:
    """The report as the text the CLI prints."""
    lines = [
        f"model          {r.path}",
        f"format         {r.format}, {_human(r.file_bytes)}",
        f"architecture   {r.architecture}",
        f"parameters     {_human(r.parameters, '')}",
        f"context        {r.context_length} tokens",
        f"chat template  {r.chat_template}",
        "tensor types   " + ("(none read)" if not r.types else ""),
    ]
    from slipstream.weights.quant import RAW_TYPES, REENCODE, iq_in_place_asked, reencoded_row_bytes
    reencoded = {RAW_TYPES[t][0]: reencoded_row_bytes(t, 256) * 8 / 256 for t in REENCODE} \
        if r.format == "gguf" and not iq_in_place_asked() else {}
    for name, s in sorted(r.types.items(), key=lambda kv: -kv[1].params):
        share = 100.0 * s.params / max(1, r.parameters)
        size = f", {_human(s.bytes)}" if s.bytes else ""
        note = (f", re-encoded at load into 4-bit planes ({reencoded[name]:.3g} bits a weight)"
                if name in reencoded else "")
        lines.append(f"  {name:<8} {s.tensors:>4} tensors, {share:5.1f}% of weights{size}{note}")
    lines.append(f"runtime        {r.runtime} (what --runtime auto picks here)")
    for rt, why in r.runtimes.items():
        lines.append(f"  {rt:<11} {'can run it' if why == 'ok' else 'no: ' + why}")
    ratio = f" ({r.resident_bytes / r.file_bytes:.2f}x the file)" if r.file_bytes else ""
    lines.append(f"loaded in      {r.load_s:.2f} s, {_human(r.resident_bytes)} resident{ratio}")
    return "\n".join(lines)
