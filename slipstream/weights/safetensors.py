"""Hugging Face checkpoint folders: config.json plus one or many *.safetensors shards."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.weights.quant import Linear


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).exists()]
        if missing:
            raise ModelLoadError(f"{folder}: missing checkpoint shard(s) {', '.join(missing)} "
                                 f"named by model.safetensors.index.json")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    return files


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in _shard_files(folder):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                state[k] = sf.get_tensor(k)
    return state


def load_hf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    state = read_state_dict(folder)

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelLoadError(f"{folder}: tensor {name} missing from the checkpoint")
        return state[name].to(torch.float32)

    def lin(prefix: str) -> Linear:
        bias = state.get(prefix + ".bias")
        return Linear.dense(get(prefix + ".weight"), bias)

    weights: dict[str, Any] = {"embed": Linear.dense(get("model.embed_tokens.weight")),
                               "norm": get("model.norm.weight")}
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        weights["lm_head"] = weights["embed"]
    else:
        weights["lm_head"] = lin("lm_head")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "attn_norm": get(p + "input_layernorm.weight"),
            "ffn_norm": get(p + "post_attention_layernorm.weight"),
            "q": lin(p + "self_attn.q_proj"), "k": lin(p + "self_attn.k_proj"),
            "v": lin(p + "self_attn.v_proj"), "o": lin(p + "self_attn.o_proj"),
            "gate": lin(p + "mlp.gate_proj"), "up": lin(p + "mlp.up_proj"),
            "down": lin(p + "mlp.down_proj"),
        }
        if cfg.qk_norm:
            layer["q_norm"] = get(p + "self_attn.q_norm.weight")
            layer["k_norm"] = get(p + "self_attn.k_norm.weight")
        weights[f"layers.{i}"] = layer
    return cfg, weights
