"""Ahead-of-time artifacts: their format and loading them back (`slipstream.compiler` writes them).

Loading a GGUF means parsing its metadata and vocabulary, re-blocking Q4_K, undoing llama.cpp's
Q/K permutation and fusing QKV and gate/up; a Hugging Face folder means reading and converting
every tensor. An artifact stores the result once, in the kernels' layout:

    DIR/slipstream-artifact.json   format version, source, config, per-weight layout, kernel settings
    DIR/weights.safetensors        packed codes, scales and mins, norms, RoPE frequencies (mmapped)
    DIR/tokenizer.json             the tokenizer as `tokenizers` serialises it (+ its settings above)
    DIR/kernel_configs.json        the GPU kernels' launch configurations (tuned with --tune on a GPU)
    DIR/plans/batch_B_context_C.json  the megakernel's validated task plans, one per (batch, context) bucket

so start-up is a memory map and a JSON read. Any path that accepts a model accepts DIR.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.weights.layers import LlamaLayer
from slipstream.weights.quant import Linear

ARTIFACT_FILE = "slipstream-artifact.json"
# 2: a Q4_K matrix may hold only its 6-bit scales (`kq`, no `scale`/`min`), which a Slipstream that reads only
# format 1 cannot run: it then asks to compile again instead of failing inside the runtime
# 3: a matrix may be one of the lattice/ternary/MXFP4 types re-encoded into the IQ4 planes (weights/quant.py
# REENCODE: format ids 116-139), which a Slipstream reading format 2 does not know
# 4: a matrix may be one of the per-16 types (IQ2_XS, IQ2_S, IQ1_M, Q3_K, Q2_K) re-encoded into the per-16 IQ planes
# (format ids 117, 122, 129, 111, 110), which a Slipstream reading format 3 does not know
FORMAT = 4
READS = (1, 2, 3, 4)   # format 1 artifacts load as they are (a Q4_K matrix's planes and 6-bit scales, or planes only)
LAYER_LINEARS = LlamaLayer.LINEARS
LAYER_VECTORS = LlamaLayer.VECTORS


def is_artifact(path: Path) -> bool:
    return path.is_dir() and (path / ARTIFACT_FILE).exists()


def put_linear(tensors: dict[str, torch.Tensor], name: str, w: Linear) -> dict[str, Any]:
    """`w`'s tensors into `tensors` under `name.*`; its spec for the manifest. A matrix stored in parts (a
    Q4_K_M file's Q4_K query/key rows beside Q6_K value rows) keeps them, each under `name.partJ`; a Q4_K
    matrix keeps its 6-bit scales (`Linear.kq`) where it still holds them."""
    spec: dict[str, Any] = {"n": w.n, "k": w.k, "fmt": w.fmt}
    for part in ("data", "scale", "min", "bias"):
        t = getattr(w, part)
        if t is not None:
            tensors[f"{name}.{part}"] = t.contiguous()
            spec[part] = True
    if w.kq is not None:
        for j, t in enumerate(w.kq):
            tensors[f"{name}.kq{j}"] = t.contiguous()
        spec["kq"] = True
    if w.parts:
        spec["parts"] = [put_linear(tensors, f"{name}.part{j}", p) for j, p in enumerate(w.parts)]
    return spec


def _get_linear(tensors: dict[str, torch.Tensor], name: str, spec: dict[str, Any]) -> Linear:
    get = lambda part: tensors[f"{name}.{part}"] if spec.get(part) else None  # noqa: E731
    parts = tuple(_get_linear(tensors, f"{name}.part{j}", p) for j, p in enumerate(spec.get("parts") or ()))
    kq = (tensors[f"{name}.kq0"], tensors[f"{name}.kq1"], tensors[f"{name}.kq2"]) if spec.get("kq") else None
    return Linear(spec["n"], spec["k"], tensors[f"{name}.data"], spec["fmt"], get("scale"), get("min"), get("bias"),
                  parts=parts or None, kq=kq)


def load_runtime_hints(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The compiled kernel configurations and plans, for the GPU runtimes (missing ones are skipped:
    the runtimes then use defaults and compile plans at start-up)."""
    from slipstream.kernels.triton.configs import KernelConfigs

    k = manifest.get("kernels", {})
    hints: dict[str, Any] = {}
    if k.get("configs") and (path / k["configs"]).exists():
        hints["kernel_configs"] = KernelConfigs.from_json((path / k["configs"]).read_text())
    plans = {tuple(int(x) for x in key.split(",")): path / f for key, f in k.get("plans", {}).items()
             if (path / f).exists()}
    if plans:
        hints["plans"] = plans     # paths: the megakernel reads (and validates) a plan when first used
    return hints


def load_artifact(path: Path):
    """The LoadedModel of an artifact directory (weights memory-mapped, nothing converted)."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer as HFTokenizer

    from slipstream.tokenizer import Tokenizer
    from slipstream.weights import LoadedModel

    try:
        manifest = json.loads((path / ARTIFACT_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable {ARTIFACT_FILE} ({e})") from None
    if manifest.get("format") not in READS:
        raise ModelLoadError(f"{path}: artifact format {manifest.get('format')!r}, this Slipstream reads "
                             f"{', '.join(map(str, READS))}; compile the model again")
    for f in ("weights.safetensors", "tokenizer.json"):
        if not (path / f).exists():
            raise ModelLoadError(f"{path}: {f} is missing from the artifact")
    try:   # a manifest that does not match its tensors (edited, or half written) is a load error
        cfg = ModelConfig(**manifest["config"])
        tensors = load_file(str(path / "weights.safetensors"))
        ws = manifest["weights"]
        embed = _get_linear(tensors, "embed", ws["embed"])
        weights: dict[str, Any] = {
            "embed": embed, "norm": tensors["norm"], "inv_freq": tensors["inv_freq"],
            "lm_head": embed if ws["lm_head"] == "embed" else _get_linear(tensors, "lm_head", ws["lm_head"]),
        }
        for i, spec in enumerate(ws["layers"]):
            weights[f"layers.{i}"] = LlamaLayer(
                **{k: _get_linear(tensors, f"layers.{i}.{k}", spec[k]) for k in LAYER_LINEARS},
                **{k: tensors.get(f"layers.{i}.{k}") for k in LAYER_VECTORS})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{path}: {ARTIFACT_FILE} does not match weights.safetensors ({type(e).__name__}: "
                             f"{e}); compile the model again") from None
    t = manifest["tokenizer"]
    tok = Tokenizer(HFTokenizer.from_file(str(path / "tokenizer.json")), vocab_size=t["vocab_size"],
                    bos_token=t["bos_token"], eos_token=t["eos_token"], unk_token=t["unk_token"],
                    pad_token=t["pad_token"], add_bos_token=t["add_bos_token"], add_eos_token=t["add_eos_token"],
                    eos_token_ids=t["eos_token_ids"], chat_templates=t["chat_templates"],
                    clean_up_tokenization_spaces=t["clean_up_tokenization_spaces"])
    tok.dummy_prefix_for_leading_space = t["dummy_prefix_for_leading_space"]
    return LoadedModel(path, cfg, weights, tok, manifest.get("name") or path.name,
                       runtime_hints=load_runtime_hints(path, manifest))
