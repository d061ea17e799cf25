"""GGUF checkpoints: config from metadata, tensors kept packed where the kernels can use them."""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import numpy as np
import torch

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.weights.gguf_file import GGUFFile
from slipstream.weights.gguf_file import GGMLType as QT
from slipstream.weights.layers import LlamaLayer
from slipstream.weights.hugepages import move_to_huge_pages
from slipstream.weights.quant import (Q4_F32, RAW_TYPES, REENCODE, Linear, reencoded_row_bytes, aligned, aligned_empty, available_memory,
                                      concat_rows, iq_in_place, iq_in_place_asked, weight_linears)

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe")
# re-blocked once at load into the native kernels' 4- and 8-bit layouts
PACKED_TYPES = {QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K}
# kept as the file's own blocks, read in place from the memory map (the IQ1-IQ3 lattice types, ternary
# and MXFP4 included: kernels/cpu/iqtypes.h)
RAW_QTYPES = {QT(t) for t in RAW_TYPES} - PACKED_TYPES
SUPPORTED_TYPES = PACKED_TYPES | RAW_QTYPES | {QT.F32}


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    if not os.path.isfile(path):
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return GGUFFile(path)
    except Exception as e:  # struct errors, bad magic or versions, unknown types on foreign files
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e})") from e


def metadata(reader: GGUFFile) -> dict[str, Any]:
    """The file's metadata without the tokenizer's large arrays (the tokenizer reads them itself)."""
    return {k: v for k, v in reader.metadata.items()
            if not k.startswith("tokenizer.ggml.") or k == "tokenizer.ggml.model"}


def config_from_gguf(reader: GGUFFile, path: str = "") -> ModelConfig:
    md = metadata(reader)
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    a = lambda k, d=None: md.get(f"{arch}.{k}", d)  # noqa: E731
    hidden = int(a("embedding_length"))
    heads = int(a("attention.head_count"))
    kv = a("attention.head_count_kv", heads)
    if isinstance(kv, list):
        kv = kv[0]
    vocab = a("vocab_size")
    if vocab is None:
        vocab = len(reader.metadata.get("tokenizer.ggml.tokens", ()))
    scaling = None
    if a("rope.scaling.type") in ("linear", "yarn"):
        scaling = {"rope_type": a("rope.scaling.type"), "factor": float(a("rope.scaling.factor", 1.0)),
                   "original_max_position_embeddings": a("rope.scaling.original_context_length")}
    names = {t.name for t in reader.tensors}
    if arch in ("gemma2", "gemma3"):
        return _gemma_config(arch, a, names, hidden, heads, int(kv), int(vocab), scaling)
    if arch == "phi3":
        return _phi3_config(reader, a, names, hidden, heads, int(kv), int(vocab))
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(a("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv),
        head_dim=int(a("attention.key_length", hidden // heads)),
        intermediate_size=int(a("feed_forward_length")),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(a("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )
    if arch in ("qwen2moe", "qwen3moe"):
        # llama.cpp renormalizes Qwen3-MoE's top-k weights and not Qwen2-MoE's
        norm = a("expert_weights_norm", arch == "qwen3moe")
        moe = [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(cfg.num_layers)]
        cfg = dataclasses.replace(
            cfg, intermediate_size=int(a("feed_forward_length", 0)), num_experts=int(a("expert_count")),
            num_experts_per_tok=int(a("expert_used_count")),
            moe_intermediate_size=int(a("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(a("expert_shared_feed_forward_length", 0)),
            norm_topk_prob=bool(norm), moe_layers=tuple(moe))
    return cfg


def _gemma_config(arch: str, a: Any, names: set[str], hidden: int, heads: int, kv: int, vocab: int,
                  scaling: dict[str, Any] | None) -> ModelConfig:
    """Gemma 2 and 3 as llama.cpp writes and reads them; norms stored as (1 + w); attention scaled by
    the head size (hidden / heads for the 27Bs). Gemma 3: every sixth layer global, the others sliding
    with RoPE base 10000, q/k norms. Gemma 2: even layers sliding, one RoPE base, attention and
    final-logit soft-capping (llama.cpp's defaults 50 and 30 when the keys are absent)."""
    n = int(a("block_count"))
    head_dim = int(a("attention.key_length", hidden // heads))
    big = n == (46 if arch == "gemma2" else 62)
    if arch == "gemma2":
        types = tuple("sliding" if i % 2 == 0 else "full" for i in range(n))
    else:
        pattern = a("attention.sliding_window_pattern", 6) or 6   # a period, or (newer files) one flag per layer
        types = tuple("sliding" if flag else "full" for flag in pattern) if isinstance(pattern, list) else \
            tuple("full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(n))
    gemma2 = arch == "gemma2"
    return ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden, num_layers=n, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, intermediate_size=int(a("feed_forward_length")),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0 if gemma2 else 1e6)), rope_scaling=scaling,
        max_position_embeddings=int(a("context_length", 8192 if gemma2 else 32768)),
        tie_word_embeddings="output.weight" not in names, qk_norm=not gemma2, hidden_act="gelu_tanh",
        embed_scale=float(hidden) ** 0.5, sandwich_norms=True,
        attn_scale=(hidden / heads if big else head_dim) ** -0.5,
        sliding_window=int(a("attention.sliding_window", 4096)), layer_types=types,
        rope_local_theta=None if gemma2 else 10000.0,
        attn_softcap=float(a("attn_logit_softcapping", 50.0)) if gemma2 else None,
        final_softcap=float(a("final_logit_softcapping", 30.0)) if gemma2 else None)


def _phi3_config(reader: GGUFFile, a: Any, names: set[str], hidden: int, heads: int, kv: int,
                 vocab: int) -> ModelConfig:
    """Phi-3/3.5/4-mini as llama.cpp's converter writes them: the rotary dims in rope.dimension_count,
    LongRoPE's factors as the tensors rope_factors_short/long with the pre-training context in
    rope.scaling.original_context_length and the attention factor in rope.scaling.attn_factor."""
    n = int(a("block_count"))
    head_dim = int(a("attention.key_length", hidden // heads))
    rot = int(a("rope.dimension_count", head_dim))
    max_pos = int(a("context_length", 4096))
    scaling = None
    if "rope_factors_long.weight" in names:
        t = {x.name: x for x in reader.tensors}
        orig = int(a("rope.scaling.original_context_length", max_pos))
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": orig,
                   "short_factor": _dense(t["rope_factors_short.weight"]).reshape(-1).tolist(),
                   "long_factor": _dense(t["rope_factors_long.weight"]).reshape(-1).tolist()}
        amp = a("rope.scaling.attn_factor")
        if amp is not None:
            scaling["attention_factor"] = float(amp)
    window = int(a("attention.sliding_window", 0) or 0)
    return ModelConfig(
        architecture="phi3", vocab_size=vocab, hidden_size=hidden, num_layers=n, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, intermediate_size=int(a("feed_forward_length")),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(a("rope.freq_base", 10000.0)), rope_scaling=scaling, max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in names, rotary_dim=rot if rot != head_dim else None,
        sliding_window=window or None, layer_types=("sliding",) * n if window else None)


def _q4k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of a Q4_K super-block -> 8 six-bit scales and 8 six-bit mins."""
    sc = sc.astype(np.uint8)
    scales = np.empty(sc.shape[:-1] + (8,), np.uint8)
    mins = np.empty_like(scales)
    scales[..., :4] = sc[..., 0:4] & 63
    mins[..., :4] = sc[..., 4:8] & 63
    scales[..., 4:] = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return scales, mins


def _q4k_linear(raw: np.ndarray, n: int, k: int) -> Linear:
    """Q4_K super-blocks (256 weights, 6-bit sub-block scales) -> groups of 32 (the 4-bit layout's
    codes), each group's scale d*sc and offset -(dmin*mn) kept as their 6-bit factors and the
    super-blocks' fp16 d and dmin (`Linear.kq`): values unchanged, as the products are exact in fp32."""
    blocks = raw.reshape(n, k // 256, 144)
    sc, mn = _q4k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(n, k // 256, 4, 32)      # 64-weight chunks: low nibbles, then high
    codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k // 256, 8, 2, 16)
    packed = (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(n, k // 2)   # byte j = (j, j + 16)
    dd = np.ascontiguousarray(blocks[..., 0:4]).view(np.float16)   # [n, k/256, 2]: d, dmin as stored
    kq = (aligned(sc.reshape(n, k // 32)), aligned(mn.reshape(n, k // 32)), aligned(dd))
    return Linear(n, k, aligned(packed), Q4_F32, kq=kq)


def _linear_from_tensor(t: Any) -> Linear:
    qt = QT(t.tensor_type)
    k = int(t.shape[0])
    n = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    return _linear_from_raw(qt, np.asarray(t.data), n, k)


def expert_linears(t: Any) -> list[Linear]:
    """A stacked expert tensor (ggml shape [K, N, E]) -> E products [N, K], each kept as stored."""
    qt = QT(t.tensor_type)
    k, n, e = (int(d) for d in t.shape)
    data = np.asarray(t.data)
    return [_linear_from_raw(qt, data[i], n, k) for i in range(e)]


def _linear_from_raw(qt: "QT", raw: np.ndarray, n: int, k: int) -> Linear:
    if qt in (QT.Q4_0, QT.Q4_1, QT.Q8_0):  # ggml's block layout is the kernels' layout
        return Linear.from_blocks(int(qt), raw.reshape(n, -1), n, k)
    if qt == QT.Q4_K:
        return _q4k_linear(raw, n, k)
    if qt in RAW_QTYPES:
        return Linear.from_raw(int(qt), raw, n, k)
    return Linear.dense(torch.from_numpy(_dense_raw(qt, raw).reshape(n, k)))


def _dense(t: Any) -> np.ndarray:
    return _dense_raw(QT(t.tensor_type), np.asarray(t.data))


def _dense_raw(qt: "QT", raw: np.ndarray) -> np.ndarray:
    if qt == QT.F32:
        return np.array(raw, dtype=np.float32)  # a writable copy of the read-only map
    import gguf   # only for the types no kernel reads (norms stored as F16, say): ~3 MB of imports

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qt))).astype(np.float32)


def _unpermute(w: Linear, n_head: int) -> Linear:
    """Undo llama.cpp's Q/K row permutation (its rotary pairs are interleaved; ours are halves).
    The rows are gathered by numpy (loading touches no torch kernel: see `Linear.from_blocks`)."""
    hd = w.n // n_head
    # converted row r came from original row perm[r]; invert to get original order
    perm = np.arange(w.n).reshape(n_head, 2, hd // 2).transpose(0, 2, 1).reshape(-1)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(w.n)
    if w.parts:
        return w.select_rows(torch.from_numpy(inv))
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        a = t.numpy()
        return torch.from_numpy(np.take(a, inv, axis=0, out=aligned_empty(a.shape, a.dtype)))

    with warnings.catch_warnings():   # raw weights are read-only views of the map; the rows are copies
        warnings.simplefilter("ignore", UserWarning)
        return Linear(w.n, w.k, pick(w.data), w.fmt, pick(w.scale), pick(w.min), pick(w.bias),
                      kq=None if w.kq is None else (pick(w.kq[0]), pick(w.kq[1]), pick(w.kq[2])))  # type: ignore[arg-type]


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any], GGUFFile]:
    """Config and weights of a GGUF model; weights keyed by our own names (see models/llama.py)."""
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, str(path))
    for t in reader.tensors:
        qt = QT(t.tensor_type)
        if qt not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name} has unsupported quant type {qt.name} "
                                 f"(supported: {', '.join(sorted(x.name for x in SUPPORTED_TYPES))})")
    with iq_in_place(not _reencoding_fits(reader, str(path))):
        return _gguf_weights(reader, cfg, str(path))


def _reencoding_fits(reader: GGUFFile, path: str) -> bool:
    """Whether the file's REENCODE-type matrices (the lattice and ternary types, MXFP4, Q3_K, Q2_K), re-encoded into
    the fast kernels' planes (4.25 bits a weight, 4.5 for MXFP4, 4.56 for the per-16 planes, 5.12 for Q2_K's), fit
    in half the memory available; if not, they stay the file's blocks, with one warning (decode is then slower: the
    products decode those blocks)."""
    if iq_in_place_asked():
        return True   # asked for: the loader keeps the blocks anyway, without a word
    need: dict[str, int] = {}
    for t in reader.tensors:
        if int(t.tensor_type) in REENCODE and len(t.shape) > 1:
            name = QT(t.tensor_type).name
            rows = int(np.prod(t.shape)) // int(t.shape[0])   # gguf-py's shape: the row length first
            need[name] = need.get(name, 0) + rows * reencoded_row_bytes(int(t.tensor_type), int(t.shape[0]))
    free = available_memory() if need else None
    if free is None or sum(need.values()) <= free // 2:
        return True
    warnings.warn(f"{path}: its {', '.join(sorted(need))} weights stay as the file's blocks: re-encoding them for the "
                  f"faster kernels would take {sum(need.values()) / 2**30:.1f} GiB, more than half of the "
                  f"{free / 2**30:.1f} GiB of memory available (decode is slower; SLIPSTREAM_IQ_IN_PLACE=1 chooses this "
                  "without the warning)", stacklevel=3)
    return False


def _gguf_weights(reader: GGUFFile, cfg: ModelConfig, path: str) -> tuple[ModelConfig, dict[str, Any], GGUFFile]:
    tensors = {t.name: t for t in reader.tensors}

    def vec(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor {name} missing")
        return torch.from_numpy(_dense(tensors[name]).reshape(-1).copy())

    def lin(name: str, unpermute_heads: int = 0) -> Linear:
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor {name} missing")
        w = _linear_from_tensor(tensors[name])
        bias = name.replace(".weight", ".bias")
        if bias in tensors:
            w.bias = vec(bias)
        if unpermute_heads and cfg.architecture == "llama":
            w = _unpermute(w, unpermute_heads)
        return w

    weights: dict[str, Any] = {"embed": lin("token_embd.weight"), "norm": vec("output_norm.weight")}
    weights["lm_head"] = weights["embed"] if cfg.tie_word_embeddings else lin("output.weight")
    if "rope_freqs.weight" in tensors:  # llama3-style per-frequency factors
        weights["rope_freqs"] = vec("rope_freqs.weight")
    if cfg.num_experts:
        from slipstream.weights.moe import qwen_moe_layers_gguf
        weights.update(qwen_moe_layers_gguf(cfg, tensors, vec, lin, expert_linears))
        move_to_huge_pages(weights, (reader.data.ctypes.data, reader.data.nbytes))
        _release_converted(reader, weights)
        return cfg, weights, reader
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        if cfg.architecture == "phi3":   # fused attn_qkv (or separate q/k/v); ffn_up holds gate then up
            qkv = lin(p + "attn_qkv.weight") if p + "attn_qkv.weight" in tensors else concat_rows(
                [lin(p + "attn_q.weight"), lin(p + "attn_k.weight"), lin(p + "attn_v.weight")])
            weights[f"layers.{i}"] = LlamaLayer(
                attn_norm=vec(p + "attn_norm.weight"), ffn_norm=vec(p + "ffn_norm.weight"), qkv=qkv,
                o=lin(p + "attn_output.weight"), gate_up=lin(p + "ffn_up.weight"), down=lin(p + "ffn_down.weight"))
            continue
        weights[f"layers.{i}"] = LlamaLayer.fuse(
            attn_norm=vec(p + "attn_norm.weight"),
            ffn_norm=vec(p + "ffn_norm.weight"),
            q=lin(p + "attn_q.weight", cfg.num_heads),
            k=lin(p + "attn_k.weight", cfg.num_kv_heads),
            v=lin(p + "attn_v.weight"),
            o=lin(p + "attn_output.weight"),
            gate=lin(p + "ffn_gate.weight"),
            up=lin(p + "ffn_up.weight"),
            down=lin(p + "ffn_down.weight"),
            q_norm=vec(p + "attn_q_norm.weight") if cfg.qk_norm else None,
            k_norm=vec(p + "attn_k_norm.weight") if cfg.qk_norm else None,
            post_attn_norm=vec(p + "post_attention_norm.weight") if cfg.sandwich_norms else None,
            post_ffn_norm=vec(p + "post_ffw_norm.weight") if cfg.sandwich_norms else None)
    move_to_huge_pages(weights, (reader.data.ctypes.data, reader.data.nbytes))
    _release_converted(reader, weights)
    return cfg, weights, reader


def _release_converted(reader: GGUFFile, weights: dict[str, Any]) -> None:
    """Drop from this process's view of the memory map the pages of every tensor that is not used in
    place (converted, fused into a copy, or a norm): the tensors that are used in place keep the
    map alive, and the others' pages would otherwise stay resident next to their copies."""
    import mmap

    m = getattr(reader.data, "_mmap", None)
    if m is None or not hasattr(m, "madvise"):
        return
    base, size = reader.data.ctypes.data, reader.data.nbytes
    used: list[tuple[int, int]] = []   # file byte ranges that weights still read in place
    for part in weight_linears(weights):
        a = part.data.data_ptr()
        if base <= a < base + size:
            used.append((a - base, a - base + part.data.numel() * part.data.element_size()))
    page = mmap.PAGESIZE
    for t in reader.tensors:
        lo, hi = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
        if any(a < hi and lo < b for a, b in used):
            continue
        start, end = -(-lo // page) * page, hi // page * page
        if end > start:
            try:
                m.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):   # a platform without it: only memory is lost
                return
