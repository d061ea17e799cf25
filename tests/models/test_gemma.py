"""Gemma 3 (text) on the eager runtime against transformers' own Gemma3ForCausalLM, from a Hugging
Face folder and from a GGUF written the way llama.cpp's converter writes it: GeGLU (tanh GELU),
(1 + w) norms before and after attention and MLP, the embedding scaled by sqrt(hidden), q/k norms,
query_pre_attn_scalar, interleaved sliding-window and global layers with their own RoPE bases."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from support import check_native_step_against  # noqa: E402

from slipstream.kv.blocks import SequenceKV  # noqa: E402
from slipstream.models.llama import LlamaModel  # noqa: E402
from slipstream.runtime import registry  # noqa: E402
from slipstream.step import StepBuilder  # noqa: E402
from slipstream.weights.gguf import load_gguf  # noqa: E402
from slipstream.weights.safetensors import load_hf  # noqa: E402

VOCAB = 96
ATOL = 1e-4
# as Gemma 3 itself: five sliding-window layers, then a global one (llama.cpp's GGUFs assume it)
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=6,
              layer_types=LAYER_TYPES, query_pre_attn_scalar=16, rms_norm_eps=1e-6, tie_word_embeddings=True)


def hf_gemma(seed: int = 0) -> torch.nn.Module:
    config = transformers.Gemma3TextConfig(**CONFIG)
    config._attn_implementation = "eager"
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):   # Gemma multiplies by (1 + w)
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm":
              "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm":
              "post_ffw_norm", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_gguf(hf: torch.nn.Module, path: Path, quant: dict[str, gguf.GGMLQuantizationType]) -> None:
    """As llama.cpp's converter: norms stored with the 1 added; `quant` by tensor role. hf gets the
    file's (dequantized) weights back so that both compute on the same numbers."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(c.sliding_window)
    w.add_vocab_size(c.vocab_size)
    params = dict(hf.named_parameters())
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(c.num_hidden_layers):
        for src, dst in HF_TO_GGUF.items():
            names[f"model.layers.{i}.{src}.weight"] = f"blk.{i}.{dst}.weight"
    for src, dst in names.items():
        arr = params[src].detach().numpy().astype(np.float32)
        role = dst.split(".")[-2] if dst.startswith("blk.") else dst.split(".")[0]
        if "norm" in role:
            w.add_tensor(dst, arr + 1.0)
            continue
        qt = quant.get(role, gguf.GGMLQuantizationType.F32)
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(dst, arr)
            continue
        raw = gguf.quants.quantize(arr, qt)
        w.add_tensor(dst, raw, raw_dtype=qt)
        with torch.no_grad():
            params[src].copy_(torch.from_numpy(gguf.quants.dequantize(raw, qt).reshape(arr.shape).astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["hf", "gguf"])
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, LlamaModel]:
    hf = hf_gemma(seed=3)
    root = tmp_path_factory.mktemp("gemma")
    if request.param == "hf":
        hf.save_pretrained(root, safe_serialization=True)
        cfg, weights = load_hf(root)
    else:
        Q = gguf.GGMLQuantizationType
        write_gguf(hf, root / "g.gguf", {"token_embd": Q.Q8_0, "attn_q": Q.Q5_0, "attn_v": Q.Q5_1, "ffn_up": Q.Q8_0})
        cfg, weights, _ = load_gguf(root / "g.gguf")
    return hf, LlamaModel(cfg, weights)


def run(model: LlamaModel, kv, seq: SequenceKV, start: int, toks: list[int], all_rows: bool = False) -> torch.Tensor:
    seq.reserve(start + len(toks))
    b = StepBuilder()
    b.add(seq, toks, start, logits="all" if all_rows else "last")
    return model.forward(b.build(), kv)


def test_config(pair):
    hf, m = pair
    c = m.cfg
    assert c.architecture == "gemma3" and c.layer_types == ("sliding",) * 5 + ("full",)
    assert c.sliding_window == 6 and c.hidden_act == "gelu_tanh" and c.qk_norm and c.sandwich_norms
    assert registry.resolve_runtime("auto", m) == "native"   # the CPU step computes Gemma 3 (below)
    assert "Gemma 3" in (registry.unsupported("megakernel", m) or "")   # the GPU runtimes refuse it, saying why


def test_prefill_chunks_and_decode_match_transformers(pair):
    hf, m = pair
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, VOCAB, (20,), generator=g).tolist()   # longer than the window
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()
    kv = m.new_kv_cache(num_blocks=12, block_size=4)
    seq = SequenceKV(kv)
    out = run(m, kv, seq, 0, toks[:9], all_rows=True)             # prefill, then a chunk after it
    torch.testing.assert_close(out, ref[:9], atol=ATOL, rtol=0)
    out = run(m, kv, seq, 9, toks[9:14], all_rows=True)
    torch.testing.assert_close(out, ref[9:14], atol=ATOL, rtol=0)
    for p in range(14, 20):                                        # decode steps
        torch.testing.assert_close(run(m, kv, seq, p, [toks[p]])[0], ref[p], atol=ATOL, rtol=0)


def test_greedy_matches_generate(pair):
    hf, m = pair
    toks = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        gen = hf.generate(torch.tensor([toks]), max_new_tokens=14, do_sample=False)[0, 5:].tolist()
    kv = m.new_kv_cache(num_blocks=8, block_size=4)
    seq = SequenceKV(kv)
    logits = run(m, kv, seq, 0, toks)
    ours = []
    for i in range(14):
        ours.append(int(logits[0].argmax()))
        logits = run(m, kv, seq, len(toks) + i, [ours[-1]])
    assert ours == gen


@pytest.mark.parametrize("exact", [True, False])
def test_native_step_matches_transformers(pair, exact):
    """The native CPU step (runtime/cpu_team.py) on Gemma 3: GELU GLU, post-norms through their own tasks,
    the scaled embedding, sliding-window layers with the local RoPE base; prompt chunks past the window
    as rows of the step, then decode rows. Exact path within float32 noise of transformers; the fast
    path (int8 activations) close, choosing the same tokens up to near ties."""
    check_native_step_against(*pair, VOCAB, 20, (9, 14), exact, num_blocks=12)
