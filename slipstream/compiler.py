"""`slipstream compile MODEL --out DIR`: the artifact compiler.

It sits above the layers it combines: it loads a model (weights/, models/), compiles and validates
the megakernel's plans (runtime/), writes the GPU kernels' configurations (kernels/) and stores all
of it in the artifact format that `weights/artifact.py` defines and loads.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from slipstream.errors import SlipstreamError
from slipstream.weights.artifact import ARTIFACT_FILE, FORMAT, LAYER_LINEARS, LAYER_VECTORS, is_artifact, put_linear
from slipstream.weights.quant import DENSE_FROM_ROWS

PLAN_BATCHES = (1, 2, 4, 8)
GPU_PROGRAMS = 132   # the megakernel's programs when this machine has no GPU: an H100's (and H200's) SMs


def compile_model(model_name: str | os.PathLike | None, out: str | os.PathLike, *,
                  plan_context: int | None = None, block_size: int = 16, tune: bool = False,
                  num_programs: int | None = None) -> dict[str, Any]:
    """Load a model the ordinary way and write its artifact; returns the manifest. The megakernel's
    plans are compiled for contexts up to `plan_context` (default: the model's maximum) and the
    cache's `block_size`, with the tiles the runtime would choose (`plan.default_tiles`) for
    `num_programs` persistent programs (default: this machine's GPU's SMs, else `GPU_PROGRAMS`);
    `tune` times the matvec tiles on this machine's GPU."""
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
    weights: dict[str, Any] = {"embed": put_linear(tensors, "embed", model.embed)}
    weights["lm_head"] = "embed" if model.lm_head is model.embed else put_linear(tensors, "lm_head", model.lm_head)
    layers = []
    for i, L in enumerate(model.layers):
        spec = {k: put_linear(tensors, f"layers.{i}.{k}", getattr(L, k)) for k in LAYER_LINEARS}
        for k in LAYER_VECTORS:
            if getattr(L, k) is not None:
                tensors[f"layers.{i}.{k}"] = getattr(L, k).contiguous()
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
            "add_bos_token": tok.add_special_tokens[0],
            "add_eos_token": tok.add_special_tokens[1],
            "eos_token_ids": sorted(tok.eos_token_ids), "chat_templates": tok.chat_templates,
            "clean_up_tokenization_spaces": tok.clean_up_tokenization_spaces,
            "dummy_prefix_for_leading_space": tok.dummy_prefix_for_leading_space,
        },
        "compile_s": None,
    }
    manifest["kernels"].update(_write_kernel_plans(model, out, plan_context, block_size, tune, num_programs))
    manifest["compile_s"] = round(time.perf_counter() - t0, 3)
    (out / ARTIFACT_FILE).write_text(json.dumps(manifest, indent=1))
    return manifest


def _write_kernel_plans(model, out: Path, plan_context: int | None, block_size: int, tune: bool,
                        num_programs: int | None = None) -> dict[str, Any]:
    """kernel_configs.json and the megakernel plans (validated), when the model's shape allows them."""
    from slipstream.kernels.triton.configs import KernelConfigs, decode_shapes, tune_matvec
    from slipstream.runtime.buckets import context_buckets
    from slipstream.runtime.plan import WeightLayout, compile_plan, default_tiles, supports, validate

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
    if num_programs is None:
        num_programs = (torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available()
                        else GPU_PROGRAMS)
    layout = WeightLayout.for_config(model.cfg, tied=model.embed is model.lm_head)
    (out / "plans").mkdir(exist_ok=True)
    for b in PLAN_BATCHES:
        for c in context_buckets(context):
            plan = compile_plan(model.cfg, b, c, block_size, layout, default_tiles(model.cfg, c, num_programs))
            validate(plan)
            plan.save(out / "plans" / f"batch_{b}_context_{c}.json")
            info["plans"][f"{b},{c}"] = f"plans/batch_{b}_context_{c}.json"
    info.update(plan_context=context, plan_block_size=block_size, plan_programs=num_programs)
    return info
