"""Ahead-of-time artifacts: `slipstream compile MODEL --out DIR` and loading DIR back.

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

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError, SlipstreamError
from slipstream.weights.quant import DENSE_FROM_ROWS, Linear

ARTIFACT_FILE = "slipstream-artifact.json"
FORMAT = 1
LAYER_LINEARS = ("qkv", "o", "gate_up", "down")
LAYER_VECTORS = ("attn_norm", "ffn_norm", "q_norm", "k_norm")


def is_artifact(path: Path) -> bool:
    return path.is_dir() and (path / ARTIFACT_FILE).exists()


def _put_linear(tensors: dict[str, torch.Tensor], name: str, w: Linear) -> dict[str, Any]:
    spec: dict[str, Any] = {"n": w.n, "k": w.k, "fmt": w.fmt}
    for part in ("data", "scale", "min", "bias"):
        t = getattr(w, part)
        if t is not None:
            tensors[f"{name}.{part}"] = t.contiguous()
            spec[part] = True
    return spec


def _get_linear(tensors: dict[str, torch.Tensor], name: str, spec: dict[str, Any]) -> Linear:
    get = lambda part: tensors[f"{name}.{part}"] if spec.get(part) else None  # noqa: E731
    return Linear(spec["n"], spec["k"], tensors[f"{name}.data"], spec["fmt"], get("scale"), get("min"), get("bias"))


PLAN_BATCHES = (1, 2, 4, 8)


def compile_model(model_name: str | os.PathLike | None, out: str | os.PathLike, *,
                  plan_context: int | None = None, block_size: int = 16, tune: bool = False) -> dict[str, Any]:
    """Load a model the ordinary way and write its artifact; returns the manifest. The megakernel's
    plans are compiled for contexts up to `plan_context` (default: the model's maximum) and the
    cache's `block_size`; `tune` times the matvec tiles on this machine's GPU."""
    from safetensors.torch import save_file

    from slipstream import __version__
    from slipstream.models import build_model
    from slipstream.models.llama import LlamaModel
    from slipstream.weights import load_model

    t0 = time.perf_counter()
    loaded = load_model(model_name)
    if is_artifact(loaded.path):
        raise SlipstreamError(f"{loaded.path} is already a compiled artifact")
    model = build_model(loaded.config, loaded.weights)
    if not isinstance(model, LlamaModel):
        raise SlipstreamError("slipstream compile supports the Llama family (Llama, Mistral, Qwen2/3, SmolLM2) "
                              "for now")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {"norm": model.norm.contiguous(), "inv_freq": model.inv_freq.contiguous()}
    weights: dict[str, Any] = {"embed": _put_linear(tensors, "embed", model.embed)}
    weights["lm_head"] = "embed" if model.lm_head is model.embed else _put_linear(tensors, "lm_head", model.lm_head)
    layers = []
    for i, L in enumerate(model.layers):
        spec = {k: _put_linear(tensors, f"layers.{i}.{k}", L[k]) for k in LAYER_LINEARS}
        for k in LAYER_VECTORS:
            if L.get(k) is not None:
                tensors[f"layers.{i}.{k}"] = L[k].contiguous()
        layers.append(spec)
    weights["layers"] = layers
    save_file(tensors, str(out / "weights.safetensors"))
    tok = loaded.tokenizer
    tok.backend.save(str(out / "tokenizer.json"))
    src = loaded.path.stat()
    manifest = {
        "format": FORMAT, "slipstream": __version__, "name": loaded.name,
        "source": {"path": str(loaded.path), "bytes": src.st_size if loaded.path.is_file() else None,
                   "mtime": src.st_mtime},
        "config": dataclasses.asdict(loaded.config),
        "weights": weights,
        "kernels": {"layout": "packed nibbles/int8 + fp32 group-32 scale/min (weights/quant.py)",
                    "dense_from_rows": DENSE_FROM_ROWS, "fused": ["qkv", "gate_up"]},
        "tokenizer": {
            "vocab_size": tok.vocab_size, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "unk_token": tok.unk_token, "pad_token": tok.pad_token,
            "add_bos_token": None if tok._use_post_processor else tok._add_bos,
            "add_eos_token": None if tok._use_post_processor else tok._add_eos,
            "eos_token_ids": sorted(tok.eos_token_ids), "chat_templates": tok.chat_templates,
            "clean_up_tokenization_spaces": tok.clean_up_tokenization_spaces,
            "dummy_prefix_for_leading_space": tok._dummy_prefix_for_leading_space,
        },
        "compile_s": None,
    }
    manifest["kernels"].update(_write_kernel_plans(model, out, plan_context, block_size, tune))
    manifest["compile_s"] = round(time.perf_counter() - t0, 3)
    (out / ARTIFACT_FILE).write_text(json.dumps(manifest, indent=1))
    return manifest


def _write_kernel_plans(model, out: Path, plan_context: int | None, block_size: int, tune: bool) -> dict[str, Any]:
    """kernel_configs.json and the megakernel plans (validated), when the model's shape allows them."""
    from slipstream.kernels.triton.configs import KernelConfigs, decode_shapes, tune_matvec
    from slipstream.runtime.buckets import context_buckets
    from slipstream.runtime.plan import TileConfig, WeightLayout, compile_plan, supports, validate

    configs = KernelConfigs()
    if tune:
        if not torch.cuda.is_available():
            raise SlipstreamError("--tune measures the kernels on a GPU; this machine has none")
        configs = tune_matvec(decode_shapes(model.cfg, list(PLAN_BATCHES)))
    (out / "kernel_configs.json").write_text(configs.to_json())
    info: dict[str, Any] = {"configs": "kernel_configs.json", "tuned_on": configs.device or None, "plans": {}}
    why = supports(model)
    if why:
        info["plans_skipped"] = why
        return info
    context = plan_context or model.cfg.max_position_embeddings
    layout = WeightLayout.for_config(model.cfg, tied=model.embed is model.lm_head)
    (out / "plans").mkdir(exist_ok=True)
    for b in PLAN_BATCHES:
        for c in context_buckets(context):
            plan = compile_plan(model.cfg, b, c, block_size, layout, TileConfig())
            validate(plan)
            plan.save(out / "plans" / f"batch_{b}_context_{c}.json")
            info["plans"][f"{b},{c}"] = f"plans/batch_{b}_context_{c}.json"
    info.update(plan_context=context, plan_block_size=block_size)
    return info


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
    if manifest.get("format") != FORMAT:
        raise ModelLoadError(f"{path}: artifact format {manifest.get('format')!r}, this Slipstream reads "
                             f"{FORMAT}; compile the model again")
    for f in ("weights.safetensors", "tokenizer.json"):
        if not (path / f).exists():
            raise ModelLoadError(f"{path}: {f} is missing from the artifact")
    cfg = ModelConfig(**manifest["config"])
    tensors = load_file(str(path / "weights.safetensors"))
    ws = manifest["weights"]
    embed = _get_linear(tensors, "embed", ws["embed"])
    weights: dict[str, Any] = {
        "embed": embed, "norm": tensors["norm"], "inv_freq": tensors["inv_freq"],
        "lm_head": embed if ws["lm_head"] == "embed" else _get_linear(tensors, "lm_head", ws["lm_head"]),
    }
    for i, spec in enumerate(ws["layers"]):
        layer: dict[str, Any] = {k: _get_linear(tensors, f"layers.{i}.{k}", spec[k]) for k in LAYER_LINEARS}
        for k in LAYER_VECTORS:
            layer[k] = tensors.get(f"layers.{i}.{k}")
        weights[f"layers.{i}"] = layer
    t = manifest["tokenizer"]
    tok = Tokenizer(HFTokenizer.from_file(str(path / "tokenizer.json")), vocab_size=t["vocab_size"],
                    bos_token=t["bos_token"], eos_token=t["eos_token"], unk_token=t["unk_token"],
                    pad_token=t["pad_token"], add_bos_token=t["add_bos_token"], add_eos_token=t["add_eos_token"],
                    eos_token_ids=t["eos_token_ids"], chat_templates=t["chat_templates"],
                    clean_up_tokenization_spaces=t["clean_up_tokenization_spaces"])
    tok._dummy_prefix_for_leading_space = t["dummy_prefix_for_leading_space"]
    return LoadedModel(path, cfg, weights, tok, manifest.get("name") or path.name,
                       runtime_hints=load_runtime_hints(path, manifest))
