"""The Llama family (Llama with GQA / llama3 RoPE / tied embeddings, Qwen2, Qwen3) against transformers.

Each tiny model is built once per module with random float32 weights (every parameter re-drawn, so
biases and norm weights are not the trivial zeros/ones), saved as safetensors, loaded with
`load_hf` and compared with transformers' own class on the same weights: prefill logits at every
position, chunked prefill + decode over a paged KV cache (contiguous and gathered slots), batched
steps against each sequence run alone, and greedy generation.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from support import random_blocks

transformers = pytest.importorskip("transformers")

from slipstream.config import ModelConfig  # noqa: E402
from slipstream.errors import ModelLoadError  # noqa: E402
from slipstream.kv.blocks import PagedKVCache, SequenceKV  # noqa: E402
from slipstream.models.llama import LlamaModel  # noqa: E402
from slipstream.step import StepBuilder  # noqa: E402
from slipstream.weights.safetensors import load_hf  # noqa: E402

VOCAB = 300
ATOL = 1e-4

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)

VARIANTS = {
    "llama_gqa": ("llama", dict(rope_theta=10000.0), {}),
    # llama3 scaling with a small original context so high, medium and low frequency bands all occur
    "llama3_rope": ("llama", dict(rope_theta=10000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}), {}),
    "llama_tied": ("llama", dict(tie_word_embeddings=True), {}),
    "llama_sharded": ("llama", dict(), {"max_shard_size": "60KB"}),
    "qwen2": ("qwen2", dict(), {}),                   # q/k/v biases
    "qwen3": ("qwen3", dict(head_dim=24), {}),        # q/k norm, head_dim != hidden / heads
}


@dataclass
class Tiny:
    name: str
    folder: Path
    hf: torch.nn.Module
    cfg: ModelConfig
    model: LlamaModel


def _hf_model(kind: str, extra: dict, seed: int) -> torch.nn.Module:
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    config = cls[0](**{**COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls[1](config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:  # logits of order 1 so that greedy choices are not decided by rounding noise
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory) -> Tiny:
    name = request.param
    kind, extra, save_kw = VARIANTS[name]
    hf = _hf_model(kind, extra, seed=sorted(VARIANTS).index(name))
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder, safe_serialization=True, **save_kw)
    cfg, weights = load_hf(folder)
    return Tiny(name, folder, hf, cfg, LlamaModel(cfg, weights))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    hf = _hf_model("llama", {}, seed=99)
    folder = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(folder, safe_serialization=True, max_shard_size="60KB")
    return folder


# -- helpers ------------------------------------------------------------------------------------

def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def run_step(model: LlamaModel, kv: PagedKVCache, parts: list[tuple[SequenceKV, int, list[int]]],
             gather: bool = False, all_rows: bool = False) -> torch.Tensor:
    """One step over several sequences: (seq, tokens already cached, new tokens) each."""
    b = StepBuilder()
    for seq, start, toks in parts:
        seq.reserve(start + len(toks))
        b.add(seq, toks, start, logits="all" if all_rows else "last", gather=gather)
    return model.forward(b.build(), kv)


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    diff = (a - b).abs().max().item()
    assert diff < atol, f"max abs diff {diff:.3g} (logits scale {b.abs().max().item():.3g})"


# -- config -------------------------------------------------------------------------------------

def test_config_matches_hf(tiny: Tiny):
    c, h = tiny.cfg, tiny.hf.config
    assert c.vocab_size == VOCAB and c.num_layers == 2
    assert c.num_heads == 4 and c.num_kv_heads == 2
    assert c.head_dim == (24 if tiny.name == "qwen3" else 16)
    assert c.architecture == {"qwen2": "qwen2", "qwen3": "qwen3"}.get(tiny.name, "llama")
    assert c.qk_norm == (tiny.name == "qwen3")
    assert c.attention_bias == (tiny.name == "qwen2")
    assert c.tie_word_embeddings == (tiny.name == "llama_tied")
    if tiny.name == "llama3_rope":
        assert c.rope_scaling and c.rope_scaling["rope_type"] == "llama3"
    if tiny.name == "llama_sharded":
        assert (tiny.folder / "model.safetensors.index.json").exists()
        assert len(list(tiny.folder.glob("*.safetensors"))) > 2
    assert c.rms_norm_eps == h.rms_norm_eps


def test_rope_matches_hf(tiny: Tiny):
    """Our inverse frequencies (incl. llama3 scaling) equal transformers' rotary embedding's."""
    hf_inv = tiny.hf.model.rotary_emb.inv_freq.float()
    assert torch.allclose(tiny.model.inv_freq, hf_inv, rtol=1e-6, atol=0)


# -- (a) prefill --------------------------------------------------------------------------------

def test_prefill_all_positions(tiny: Tiny):
    toks = prompt(23, seed=1)
    kv = tiny.model.new_kv_cache(num_blocks=8, block_size=4)
    ours = run_step(tiny.model, kv, [(SequenceKV(kv), 0, toks)], all_rows=True)
    ref = hf_logits(tiny.hf, toks)
    assert ours.shape == ref.shape == (23, VOCAB)
    assert_close(ours, ref)


# -- (b) chunked prefill + decode ---------------------------------------------------------------

@pytest.mark.parametrize("gather", [False, True], ids=["contiguous", "gathered"])
def test_chunked_prefill_then_decode(tiny: Tiny, gather: bool):
    toks = prompt(20, seed=2)
    n_prompt, split = 13, 6
    ref = hf_logits(tiny.hf, toks)
    kv = tiny.model.new_kv_cache(num_blocks=16, block_size=4)
    seq = SequenceKV(kv)
    other = SequenceKV(kv)
    if gather:  # interleave another sequence's blocks so ours are not consecutive
        seq.reserve(4)
        other.reserve(4)
        seq.reserve(12)
        other.reserve(8)
        assert seq.contiguous_range(n_prompt) is None
    # chunk 1: the first `split` tokens; chunk 2: the rest of the prompt (every row checked)
    out1 = run_step(tiny.model, kv, [(seq, 0, toks[:split])], gather=gather)
    assert_close(out1[0], ref[split - 1])
    out2 = run_step(tiny.model, kv, [(seq, split, toks[split:n_prompt])], gather=gather,
                    all_rows=True)
    assert_close(out2, ref[split:n_prompt])
    for p in range(n_prompt, len(toks)):  # decode, one token at a time
        out = run_step(tiny.model, kv, [(seq, p, [toks[p]])], gather=gather)
        assert out.shape == (1, VOCAB)
        assert_close(out[0], ref[p])
    seq.release()
    other.release()
    assert kv.allocator.num_free == kv.num_blocks


# -- batching -----------------------------------------------------------------------------------

def test_batched_step_equals_alone(tiny: Tiny):
    """Two sequences in one step (prefill, then decode, one of them gathered) equal each alone."""
    a, b = prompt(12, seed=3), prompt(14, seed=4)  # a fills 3 blocks of 4
    next_a, next_b = prompt(3, seed=5), prompt(3, seed=6)
    m = tiny.model

    alone = {}
    for key, toks, nxt in (("a", a, next_a), ("b", b, next_b)):
        kv = m.new_kv_cache(num_blocks=16, block_size=4)
        seq = SequenceKV(kv)
        outs = [run_step(m, kv, [(seq, 0, toks)], all_rows=True)]
        for i, t in enumerate(nxt):
            outs.append(run_step(m, kv, [(seq, len(toks) + i, [t])]))
        alone[key] = outs

    kv = m.new_kv_cache(num_blocks=16, block_size=4)
    sa, sb = SequenceKV(kv), SequenceKV(kv)
    # batched prefill of both prompts, all rows
    out = run_step(m, kv, [(sa, 0, a), (sb, 0, b)], all_rows=True)
    assert_close(out[:len(a)], alone["a"][0], atol=1e-5)
    assert_close(out[len(a):], alone["b"][0], atol=1e-5)
    # sa's next block comes after sb's: decode steps read sa through gathered slot ids
    for i in range(3):
        out = run_step(m, kv, [(sa, len(a) + i, [next_a[i]]), (sb, len(b) + i, [next_b[i]])])
        assert out.shape == (2, VOCAB)
        assert_close(out[0], alone["a"][i + 1][0], atol=1e-5)
        assert_close(out[1], alone["b"][i + 1][0], atol=1e-5)
    assert sa.contiguous_range(len(a) + 3) is None


def test_batched_mixed_prefill_and_decode(tiny: Tiny):
    """A decode token of one sequence and a prefill chunk of another share a step."""
    a, b = prompt(10, seed=7), prompt(8, seed=8)
    ref_a, ref_b = hf_logits(tiny.hf, a), hf_logits(tiny.hf, b)
    kv = tiny.model.new_kv_cache(num_blocks=16, block_size=4)
    sa, sb = SequenceKV(kv), SequenceKV(kv)
    run_step(tiny.model, kv, [(sa, 0, a[:9])])
    run_step(tiny.model, kv, [(sb, 0, b[:3])])
    out = run_step(tiny.model, kv, [(sa, 9, a[9:]), (sb, 3, b[3:])], gather=True, all_rows=True)
    assert_close(out[0], ref_a[9])
    assert_close(out[1:], ref_b[3:])


# -- (c) greedy generation ----------------------------------------------------------------------

def test_greedy_matches_generate(tiny: Tiny):
    toks = prompt(7, seed=9)
    n_new = 16
    with torch.no_grad():
        gen = tiny.hf.generate(torch.tensor([toks]), max_new_tokens=n_new, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    expected = gen[0, len(toks):].tolist()
    assert len(expected) == n_new

    kv = tiny.model.new_kv_cache(num_blocks=8, block_size=4)
    seq = SequenceKV(kv)
    logits = run_step(tiny.model, kv, [(seq, 0, toks)])
    ours = []
    for i in range(n_new):
        t = int(logits[0].argmax())
        ours.append(t)
        logits = run_step(tiny.model, kv, [(seq, len(toks) + i, [t])])
    assert ours == expected


# -- errors -------------------------------------------------------------------------------------

def test_missing_shard_names_file(sharded: Path, tmp_path: Path):
    folder = tmp_path / "broken"
    shutil.copytree(sharded, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (folder / victim).unlink()
    with pytest.raises(ModelLoadError, match=victim.replace(".", r"\.")):
        load_hf(folder)


def test_sharded_folder_loads(sharded: Path):
    cfg, weights = load_hf(sharded)
    assert cfg.num_layers == 2 and "layers.1" in weights


def test_unsupported_model_type(sharded: Path, tmp_path: Path):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(sharded, folder)
    conf = json.loads((folder / "config.json").read_text())
    conf["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_hf(folder)


def test_no_config_json(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf(tmp_path)


def test_missing_tensor(sharded: Path, tmp_path: Path):
    """A checkpoint without one layer's weights: a ModelLoadError naming the tensor, not a KeyError."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "partial"
    folder.mkdir()
    shutil.copy(sharded / "config.json", folder / "config.json")
    state = {}
    for f in sorted(sharded.glob("*.safetensors")):
        state.update(load_file(f))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.down_proj.weight"):
        load_hf(folder)


# -- the same model from a GGUF file ------------------------------------------------------------
# A tiny llama (GQA) written the way llama.cpp's converter writes it (Q/K rows permuted), in float
# and in packed formats; transformers gets the very weights the file holds (dequantized by gguf-py),
# so the comparison checks config_from_gguf, _unpermute, the packed kernels and tied embeddings.

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from slipstream.weights.gguf import load_gguf  # noqa: E402

GGUF_VARIANTS = {
    "f32": dict(tied=False, types={"output": QT.F16}),
    # llama3 RoPE arrives as a rope_freqs.weight tensor of per-frequency factors
    "llama3_freqs": dict(tied=False, types={}, extra=dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "packed_tied": dict(tied=True, types={
        "token_embd": QT.Q8_0, "attn_q": QT.Q4_0, "attn_k": QT.Q4_0, "attn_v": QT.Q4_0,
        "attn_output": QT.Q8_0, "ffn_gate": QT.Q4_1, "ffn_up": QT.Q4_1, "ffn_down": QT.Q4_K}),
    # the types kept as the file's blocks, mixed as llama.cpp's K-quant mixes do (fused QKV of three types)
    "raw_mixed": dict(tied=False, types={
        "token_embd": QT.Q5_1, "attn_q": QT.Q5_0, "attn_k": QT.Q5_1, "attn_v": QT.IQ4_NL,
        "attn_output": QT.BF16, "ffn_gate": QT.F16, "ffn_up": QT.Q8_0, "ffn_down": QT.Q6_K, "output": QT.IQ4_NL}),
    # every other 256-weight type where K allows it (ffn_down: K = 256)
    **{f"down_{t.name}": dict(tied=True, types={"token_embd": QT.Q5_0, "attn_q": QT.Q5_0, "attn_k": QT.Q5_0,
                                                "attn_v": QT.Q5_0, "ffn_down": t})
       for t in (QT.Q2_K, QT.Q3_K, QT.Q5_K, QT.IQ4_XS, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S,
                 QT.IQ1_S, QT.IQ1_M, QT.TQ1_0, QT.TQ2_0)},
    # MXFP4 (32-weight blocks) stacked with Q5_0 in the fused QKV, IQ3_S (kernels/cpu/iqtypes.h)
    "lattice": dict(tied=True, types={"token_embd": QT.Q5_0, "attn_q": QT.MXFP4, "attn_k": QT.Q5_0,
                                      "attn_v": QT.Q5_0, "attn_output": QT.MXFP4, "ffn_down": QT.IQ3_S}),
}
QUANTIZABLE = {QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.BF16}   # gguf-py has quantizers for these
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}


def _permute(w, n_head: int, inverse: bool = False):
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf.py), or its inverse."""
    rows, cols = w.shape
    if inverse:
        return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _random_q4k(n: int, k: int, seed: int):
    """Random Q4_K super-blocks (gguf-py has no Q4_K quantizer) with weights of order 1/sqrt(k)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    d = rng.uniform(2e-4, 6e-4, (n, k // 256, 1)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8)
    blocks[..., 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8)  # mean ~ 0
    return blocks.reshape(n, -1)


def _llama3_rope_factors(rp: dict, head_dim: int):
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for llama3 scaling."""
    import math
    freqs = 1.0 / (rp["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _write_gguf(hf: torch.nn.Module, path: Path, types: dict, tied: bool) -> None:
    """Write hf's weights to `path`; then load the file's (dequantized) weights back into hf."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rp = dict(getattr(c, "rope_parameters", None) or {})
    w.add_rope_freq_base(float(rp.get("rope_theta", 10000.0)))
    w.add_vocab_size(c.vocab_size)
    if rp.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(rp, c.hidden_size // c.num_attention_heads))
    params = dict(hf.named_parameters(remove_duplicate=False))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    for i in range(c.num_hidden_layers):
        for src, dst in HF_TO_GGUF.items():
            names[f"model.layers.{i}.{src}.weight"] = f"blk.{i}.{dst}.weight"
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    for seed, (src, dst) in enumerate(names.items()):
        arr = params[src].detach().numpy().astype(np.float32)
        role = dst.split(".")[-2] if dst.startswith("blk.") else dst.split(".")[0]
        if role in heads:
            arr = _permute(arr, heads[role])
        qt = types.get(role, QT.F32)
        if qt == QT.F32:
            w.add_tensor(dst, arr)
            back = arr
        elif qt == QT.F16:
            w.add_tensor(dst, arr.astype(np.float16))
            back = arr.astype(np.float16).astype(np.float32)
        else:
            if qt == QT.Q4_K:
                raw = _random_q4k(*arr.shape, seed)
            elif qt in QUANTIZABLE:
                raw = gguf.quants.quantize(arr, qt)
            else:   # no gguf-py quantizer: hand-built blocks of the same magnitude (ternary codes are all +-d
                # or 0, so their d is the typical weight, not the largest)
                size = np.abs(arr).mean() if qt in (QT.TQ1_0, QT.TQ2_0) else np.abs(arr).max()
                raw = random_blocks(int(qt), *arr.shape, seed=seed, size=float(size))
            w.add_tensor(dst, raw, raw_dtype=qt)
            back = gguf.quants.dequantize(raw, qt).reshape(arr.shape).astype(np.float32)
        if role in heads:
            back = _permute(back, heads[role], inverse=True)
        with torch.no_grad():
            params[src].copy_(torch.from_numpy(np.ascontiguousarray(back)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(GGUF_VARIANTS))
def tiny_gguf(request, tmp_path_factory) -> Tiny:
    v = GGUF_VARIANTS[request.param]
    hf = _hf_model("llama", dict(intermediate_size=256, tie_word_embeddings=v["tied"], **v.get("extra", {})),
                   seed=42)
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    _write_gguf(hf, path, v["types"], v["tied"])
    cfg, weights, _ = load_gguf(path)
    return Tiny(request.param, path, hf, cfg, LlamaModel(cfg, weights))


def test_gguf_permute_helper_round_trips():
    w = torch.arange(32 * 3).view(32, 3).numpy()
    assert (_permute(_permute(w, 4), 4, inverse=True) == w).all()


def test_gguf_config(tiny_gguf: Tiny):
    c = tiny_gguf.cfg
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_layers) == ("llama", VOCAB, 64, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (4, 2, 16, 256)
    assert c.tie_word_embeddings == GGUF_VARIANTS[tiny_gguf.name]["tied"]
    assert c.rms_norm_eps == pytest.approx(1e-6)
    m = tiny_gguf.model
    assert torch.allclose(m.inv_freq, tiny_gguf.hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)
    if tiny_gguf.name == "packed_tied":  # kept packed in memory, fused QKV / gate+up stay packed
        from slipstream.weights.quant import Q4_0, Q4_1, Q4_F32, Q8_0
        L = m.layers[0]
        assert (L.qkv.fmt, L.o.fmt, L.gate_up.fmt, L.down.fmt) == (Q4_0, Q8_0, Q4_1, Q4_F32)
        assert m.lm_head is m.embed and m.embed.fmt == Q8_0
    elif tiny_gguf.name == "raw_mixed":   # raw blocks in place; QKV a stack of three types
        L = m.layers[0]
        assert L.qkv.format_name == "Q5_0+Q5_1+IQ4_NL"
        assert (L.o.format_name, L.gate_up.format_name, L.down.format_name) == ("BF16", "F16+Q8_0", "Q6_K")
        assert (m.embed.format_name, m.lm_head.format_name) == ("Q5_1", "IQ4_NL")
    elif tiny_gguf.name == "lattice":   # in place, as the file has them
        L = m.layers[0]
        assert (L.qkv.format_name, L.o.format_name, L.down.format_name) == ("MXFP4+Q5_0", "MXFP4", "IQ3_S")
    elif tiny_gguf.name.startswith("down_"):
        assert m.layers[0].down.format_name == tiny_gguf.name.removeprefix("down_")
    else:
        assert m.lm_head is not m.embed and not m.layers[0].qkv.packed


def test_gguf_prefill_and_decode(tiny_gguf: Tiny):
    toks = prompt(20, seed=12)
    ref = hf_logits(tiny_gguf.hf, toks)
    m = tiny_gguf.model
    kv = m.new_kv_cache(num_blocks=8, block_size=4)
    seq = SequenceKV(kv)
    out = run_step(m, kv, [(seq, 0, toks[:14])], all_rows=True)
    assert_close(out, ref[:14])
    for p in range(14, 20):
        out = run_step(m, kv, [(seq, p, [toks[p]])])
        assert_close(out[0], ref[p])


def test_gguf_greedy_matches_generate(tiny_gguf: Tiny):
    toks = prompt(7, seed=13)
    with torch.no_grad():
        gen = tiny_gguf.hf.generate(torch.tensor([toks]), max_new_tokens=16, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    kv = tiny_gguf.model.new_kv_cache(num_blocks=8, block_size=4)
    seq = SequenceKV(kv)
    logits = run_step(tiny_gguf.model, kv, [(seq, 0, toks)])
    ours = []
    for i in range(16):
        ours.append(int(logits[0].argmax()))
        logits = run_step(tiny_gguf.model, kv, [(seq, len(toks) + i, [ours[-1]])])
    assert ours == gen[0, len(toks):].tolist()


@pytest.mark.parametrize("exact", [True, False])
def test_gguf_greedy_on_the_native_runtime(tiny_gguf: Tiny, exact: bool):
    """The whole file on the native CPU step (every type, stacked QKV parts, raw embeddings): the exact
    path gives transformers' greedy tokens; the fast path (int8 activations) stays close."""
    from slipstream.kernels.cpu import load_library
    from slipstream.runtime.cpu_team import CpuTeamDecoder
    if load_library() is None:
        pytest.skip("native CPU kernels unavailable")
    toks = prompt(7, seed=13)
    with torch.no_grad():
        gen = tiny_gguf.hf.generate(torch.tensor([toks]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(toks):].tolist()
    m = tiny_gguf.model
    kv = m.new_kv_cache(num_blocks=8, block_size=4)
    team = CpuTeamDecoder(m, kv, exact=exact)
    seq = SequenceKV(kv)
    logits = run_step(m, kv, [(seq, 0, toks)])
    ours = [int(logits[0].argmax())]
    for i in range(11):
        seq.reserve(len(toks) + i + 1)
        b = StepBuilder()
        b.add(seq, [ours[-1]], len(toks) + i)
        ours.append(int(team.forward(b.build())[0].argmax()))
    if exact:
        assert ours == gen
    else:
        assert ours[:4] == gen[:4]


@pytest.mark.parametrize("gelu", [False, True])
def test_the_mlp_activation_of_a_row_does_not_depend_on_the_rows_beside_it_on_the_exact_step(gelu: bool):
    """On the exact path's eager step (blas_mode "fp32-fixed") `glu` gives a row the bits it gives it alone,
    beside up to 63 other rows, with torch on 8 threads: plain torch splits an op of more than 32768 elements
    among them at points inside rows, and rows then came out differently (intermediate size 1408). The native
    kernels it takes there agree with torch to fp32 rounding of their exp-based tanh."""
    from slipstream.models.llama import glu
    from slipstream.weights.quant import blas_mode
    f = 1408
    gu = torch.randn(64, 2 * f, generator=torch.Generator().manual_seed(1)) * 4
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        with blas_mode("fp32-fixed"):
            alone = torch.cat([glu(gu[i:i + 1], f, gelu) for i in range(64)])
            assert all(torch.equal(glu(gu[:t], f, gelu), alone[:t]) for t in (13, 23, 24, 47, 50, 64))
        assert torch.allclose(glu(gu, f, gelu), alone, rtol=1e-4, atol=1e-5)   # torch, one call (the fast path)
    finally:
        torch.set_num_threads(threads)
