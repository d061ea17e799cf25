"""Hugging Face checkpoint folders: config.json plus one or many *.safetensors shards."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from slipstream.config import DeepseekConfig, ModelConfig, config_from_hf
from slipstream.errors import ModelLoadError
from slipstream.weights.deepseek import (
    DeepseekLayer,
    DeepseekMoe,
    DenseMlp,
    GqaAttention,
    Indexer,
    MlaAttention,
    MtpLayer,
)
from slipstream.weights.layers import LlamaLayer
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


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def dequantize_fp8(state: dict[str, torch.Tensor], block: tuple[int, int] = (128, 128),
                   where: str = "") -> dict[str, torch.Tensor]:
    """Replace each FP8 `X.weight` that has a block scale `X.weight_scale_inv` ([ceil(N/bn), ceil(K/bk)],
    the factor each bn x bk tile was divided by) with its float32 value; the scales are dropped."""
    out: dict[str, torch.Tensor] = {}
    bn, bk = block
    for name, t in state.items():
        if name.endswith("_scale_inv") and name[:-len("_scale_inv")] in state:
            continue
        if t.dtype in FP8_DTYPES:
            scale = state.get(name + "_scale_inv")
            if scale is None:
                raise ModelLoadError(f"{where}: FP8 tensor {name} has no {name}_scale_inv")
            n, k = t.shape
            if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
                raise ModelLoadError(f"{where}: {name}_scale_inv has shape {tuple(scale.shape)}, "
                                     f"expected {(-(-n // bn), -(-k // bk))} for {bn}x{bk} blocks")
            full = scale.to(torch.float32).repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
            out[name] = t.to(torch.float32) * full
        else:
            out[name] = t
    return out


def load_hf(path: str | os.PathLike) -> tuple[ModelConfig | DeepseekConfig, dict[str, Any]]:
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    raw_cfg = json.loads(cfg_file.read_text())
    cfg = config_from_hf(raw_cfg)
    state = read_state_dict(folder)
    if any(t.dtype in FP8_DTYPES for t in state.values()):
        qc = raw_cfg.get("quantization_config") or {}
        block = tuple(qc.get("weight_block_size") or (128, 128))
        state = dequantize_fp8(state, block, str(folder))  # type: ignore[arg-type]
    if isinstance(cfg, DeepseekConfig):
        return cfg, _deepseek_weights(cfg, state, folder)

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelLoadError(f"{folder}: tensor {name} missing from the checkpoint")
        return state[name].to(torch.float32)

    def lin(prefix: str) -> Linear:
        bias = state.get(prefix + ".bias")
        return Linear.dense(get(prefix + ".weight"), bias)

    gemma = cfg.architecture in ("gemma2", "gemma3")

    def norm(name: str) -> torch.Tensor:   # Gemma's norms multiply by (1 + w): stored with the 1 added
        return get(name) + 1.0 if gemma else get(name)

    weights: dict[str, Any] = {"embed": Linear.dense(get("model.embed_tokens.weight")),
                               "norm": norm("model.norm.weight")}
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        weights["lm_head"] = weights["embed"]
    else:
        weights["lm_head"] = lin("lm_head")
    if cfg.num_experts:
        from slipstream.weights.moe import qwen_moe_layers_hf
        weights.update(qwen_moe_layers_hf(cfg, get, lin))
        return cfg, weights
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.architecture == "phi3":   # fused qkv_proj and gate_up_proj, as our layers hold them
            weights[f"layers.{i}"] = LlamaLayer(
                attn_norm=get(p + "input_layernorm.weight"), ffn_norm=get(p + "post_attention_layernorm.weight"),
                qkv=lin(p + "self_attn.qkv_proj"), o=lin(p + "self_attn.o_proj"),
                gate_up=lin(p + "mlp.gate_up_proj"), down=lin(p + "mlp.down_proj"))
            continue
        # Gemma: post_attention_layernorm normalizes the attention output; pre_feedforward_layernorm
        # is the MLP's input norm (Llama's post_attention_layernorm)
        weights[f"layers.{i}"] = LlamaLayer.fuse(
            attn_norm=norm(p + "input_layernorm.weight"),
            ffn_norm=norm(p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")),
            q=lin(p + "self_attn.q_proj"), k=lin(p + "self_attn.k_proj"),
            v=lin(p + "self_attn.v_proj"), o=lin(p + "self_attn.o_proj"),
            gate=lin(p + "mlp.gate_proj"), up=lin(p + "mlp.up_proj"),
            down=lin(p + "mlp.down_proj"),
            q_norm=norm(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
            k_norm=norm(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
            post_attn_norm=norm(p + "post_attention_layernorm.weight") if gemma else None,
            post_ffn_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None)
    return cfg, weights


def _deepseek_weights(cfg: DeepseekConfig, state: dict[str, torch.Tensor], folder: Path) -> dict[str, Any]:
    """HF names -> the typed float32 layers `slipstream.models.deepseek` reads (`weights.deepseek`:
    MLA's kv_b split per head, GQA's q/k/v fused, experts stacked)."""
    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelLoadError(f"{folder}: tensor {name} missing from the checkpoint")
        return state[name].to(torch.float32)

    def opt(name: str) -> torch.Tensor | None:
        return state[name].to(torch.float32) if name in state else None

    def mlp(p: str) -> DenseMlp:
        return DenseMlp.fuse(get(p + "gate_proj.weight"), get(p + "up_proj.weight"), get(p + "down_proj.weight"))

    def attention(a: str, indexer: bool) -> MlaAttention | GqaAttention:
        o, o_bias = get(a + "o_proj.weight"), opt(a + "o_proj.bias")
        if cfg.attention == "gqa":
            return GqaAttention.fuse(
                q=get(a + "q_proj.weight"), k=get(a + "k_proj.weight"), v=get(a + "v_proj.weight"), o=o,
                q_bias=opt(a + "q_proj.bias"), k_bias=opt(a + "k_proj.bias"), v_bias=opt(a + "v_proj.bias"),
                o_bias=o_bias, q_norm=get(a + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=get(a + "k_norm.weight") if cfg.qk_norm else None)
        x = a + "indexer."
        w_uk, w_uv = MlaAttention.split_kv_b(get(a + "kv_b_proj.weight"), cfg.num_heads, cfg.qk_nope_head_dim,
                                             cfg.v_head_dim)
        q_latent = cfg.q_lora_rank is not None
        return MlaAttention(
            kv_a=get(a + "kv_a_proj_with_mqa.weight"), kv_a_norm=get(a + "kv_a_layernorm.weight"),
            w_uk=w_uk, w_uv=w_uv, o=o, o_bias=o_bias, kv_a_bias=opt(a + "kv_a_proj_with_mqa.bias"),
            q=None if q_latent else get(a + "q_proj.weight"),
            q_a=get(a + "q_a_proj.weight") if q_latent else None,
            q_a_bias=opt(a + "q_a_proj.bias") if q_latent else None,
            q_a_norm=get(a + "q_a_layernorm.weight") if q_latent else None,
            q_b=get(a + "q_b_proj.weight") if q_latent else None,
            indexer=Indexer(wq_b=get(x + "wq_b.weight"), wk=get(x + "wk.weight"), k_norm=get(x + "k_norm.weight"),
                            k_norm_bias=get(x + "k_norm.bias"), weights_proj=get(x + "weights_proj.weight"))
            if indexer else None)

    def ffn(m: str, mlp_type: str) -> DenseMlp | DeepseekMoe:
        if mlp_type == "dense":
            return mlp(m)
        return DeepseekMoe.stack(get(m + "gate.weight"), opt(m + "gate.e_score_correction_bias"),
                                 [mlp(m + f"experts.{e}.") for e in range(cfg.n_routed_experts)],
                                 mlp(m + "shared_experts.") if cfg.n_shared_experts else None)

    def layer(i: int, mlp_type: str, indexer: bool) -> DeepseekLayer:
        p = f"model.layers.{i}."
        return DeepseekLayer(attn_norm=get(p + "input_layernorm.weight"),
                             ffn_norm=get(p + "post_attention_layernorm.weight"),
                             attn=attention(p + "self_attn.", indexer), ffn=ffn(p + "mlp.", mlp_type))

    weights: dict[str, Any] = {"embed": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in state
    weights["lm_head"] = weights["embed"] if tied else get("lm_head.weight")
    for i in range(cfg.num_layers):
        weights[f"layers.{i}"] = layer(i, cfg.mlp_layer_types[i],
                                       cfg.dsa and cfg.indexer_types[i] == "full")
    # MTP layers sit after the main ones (model.layers.{num_layers + j}); optional in a checkpoint
    # (transformers drops them), loaded when present
    for j in range(cfg.num_nextn_predict_layers):
        i = cfg.num_layers + j
        p = f"model.layers.{i}."
        if p + "eh_proj.weight" not in state:
            break
        L = layer(i, "sparse" if cfg.n_routed_experts else "dense", cfg.dsa)
        weights[f"mtp.{j}"] = MtpLayer(
            L.attn_norm, L.ffn_norm, L.attn, L.ffn, enorm=get(p + "enorm.weight"), hnorm=get(p + "hnorm.weight"),
            eh_proj=get(p + "eh_proj.weight"), head_norm=get(p + "shared_head.norm.weight"),
            head=opt(p + "shared_head.head.weight"), embed=opt(p + "embed_tokens.weight"))
    return weights
