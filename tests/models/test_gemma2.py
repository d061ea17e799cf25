"""Gemma 2 on the eager runtime against transformers' own Gemma2ForCausalLM, from a Hugging Face
folder and from a GGUF written the way llama.cpp's converter writes it: Gemma 3's layer (GeGLU,
(1 + w) norms before and after attention and MLP, the embedding scaled by sqrt(hidden)) without q/k
norms, every other layer sliding, one RoPE base, and tanh soft-capping of the attention scores and
of the final logits (caps small enough here that the tanh bends)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from support import check_native_step_against  # noqa: E402

from slipstream.kv.blocks import SequenceKV  # noqa: E402
from slipstream.models import build_model  # noqa: E402
from slipstream.models.llama import LlamaModel  # noqa: E402
from slipstream.runtime import registry  # noqa: E402
from slipstream.step import StepBuilder  # noqa: E402
from slipstream.weights.gguf import load_gguf  # noqa: E402
from slipstream.weights.safetensors import load_hf  # noqa: E402

VOCAB = 96
ATOL = 1e-4
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=6,
              query_pre_attn_scalar=16, rms_norm_eps=1e-6, tie_word_embeddings=True,
              attn_logit_softcapping=1.5, final_logit_softcapping=2.5)


def hf_gemma2(seed: int = 0) -> torch.nn.Module:
    config = transformers.Gemma2Config(**CONFIG)
    config._attn_implementation = "eager"
    model = transformers.Gemma2ForCausalLM(config).to(torch.float32).eval()
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
              "post_ffw_norm"}


def write_gguf(hf: torch.nn.Module, path: Path, quant: dict[str, gguf.GGMLQuantizationType],
               extra: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
    """As llama.cpp's converter: norms stored with the 1 added, the soft-caps and the window as keys;
    `quant` by tensor role. hf gets the file's (dequantized) weights back."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    w.add_final_logit_softcapping(c.final_logit_softcapping)
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
    if extra is not None:   # more metadata (a tokenizer, for `slipstream inspect`)
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["hf", "gguf"])
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, LlamaModel]:
    hf = hf_gemma2(seed=3)
    root = tmp_path_factory.mktemp("gemma2")
    if request.param == "hf":
        hf.save_pretrained(root, safe_serialization=True)
        cfg, weights = load_hf(root)
    else:
        Q = gguf.GGMLQuantizationType
        write_gguf(hf, root / "g.gguf", {"token_embd": Q.Q8_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "ffn_down": Q.Q5_1})
        cfg, weights, _ = load_gguf(root / "g.gguf")
    return hf, build_model(cfg, weights)


def run(model, kv, seq: SequenceKV, start: int, toks: list[int], all_rows: bool = False) -> torch.Tensor:
    seq.reserve(start + len(toks))
    b = StepBuilder()
    b.add(seq, toks, start, logits="all" if all_rows else "last")
    return model.forward(b.build(), kv)


def test_config(pair):
    _, m = pair
    c = m.cfg
    assert c.architecture == "gemma2" and c.layer_types == ("sliding", "full") * 2 and not c.qk_norm
    assert c.attn_softcap == 1.5 and c.final_softcap == 2.5 and c.rope_local_theta is None
    assert c.sliding_window == 6 and c.hidden_act == "gelu_tanh" and c.sandwich_norms
    assert "soft-capping" in (c.eager_only() or "")


def test_the_gpu_runtimes_refuse_it_and_native_runs_it(pair):
    _, m = pair
    assert isinstance(m, LlamaModel)
    assert registry.unsupported("native", m) is None      # tested against transformers below
    for name in ("graph", "megakernel"):
        assert "the eager runtime does" in (registry.unsupported(name, m) or "")


def test_prefill_chunks_and_decode_match_transformers(pair):
    hf, m = pair
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, VOCAB, (20,), generator=g).tolist()   # longer than the window
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()
    assert ref.abs().max() < 2.5 and ref.abs().max() > 1.5        # the final cap bends the logits
    kv = m.new_kv_cache(num_blocks=12, block_size=4)
    seq = SequenceKV(kv)
    out = run(m, kv, seq, 0, toks[:9], all_rows=True)             # prefill, then a chunk after it
    torch.testing.assert_close(out, ref[:9], atol=ATOL, rtol=0)
    out = run(m, kv, seq, 9, toks[9:14], all_rows=True)
    torch.testing.assert_close(out, ref[9:14], atol=ATOL, rtol=0)
    for p in range(14, 20):                                        # decode steps
        torch.testing.assert_close(run(m, kv, seq, p, [toks[p]])[0], ref[p], atol=ATOL, rtol=0)


def test_batched_rows_match_alone(pair):
    """Two sequences in one step (a prefill beside a decode) give each its own logits."""
    _, m = pair
    a = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(8)).tolist()
    b = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(9)).tolist()
    kv = m.new_kv_cache(num_blocks=16, block_size=4)
    sa, sb = SequenceKV(kv), SequenceKV(kv)
    alone_a = run(m, kv, sa, 0, a[:9])
    alone_b = run(m, kv, sb, 0, b)
    sa.reserve(10)
    step = StepBuilder()
    step.add(sa, a[9:], 9, logits="last")
    sb2 = SequenceKV(kv)
    sb2.reserve(len(b))
    step.add(sb2, b, 0, logits="last")
    both = m.forward(step.build(), kv)
    torch.testing.assert_close(both[1], alone_b[0], atol=1e-5, rtol=0)
    assert alone_a.shape == both[:1].shape


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


def test_a_transformers_v4_config():
    """google/gemma-2-2b's config.json as transformers 4.x wrote it (no layer_types, rope_theta at the top)."""
    from slipstream.config import ModelConfig
    c = ModelConfig.from_hf(dict(
        model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=256,
        sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, cache_implementation="hybrid"))
    assert c.architecture == "gemma2" and c.rope_theta == 10000.0 and c.rope_local_theta is None
    assert c.layer_types == ("sliding", "full") * 13 and c.attn_scale == 256 ** -0.5
    assert (c.attn_softcap, c.final_softcap, c.sliding_window) == (50.0, 30.0, 4096)
    assert c.tie_word_embeddings and not c.qk_norm


NATIVE_TOKENS = 20

@pytest.mark.parametrize("exact", [True, False])
def test_native_step_matches_transformers(pair, exact):
    """The native CPU step (runtime/cpu_team.py) on this family: prompt chunks as rows of the step,
    then decode rows; exact path within float32 noise of transformers, fast path (int8 activations)
    close, choosing the same tokens up to near ties."""
    check_native_step_against(*pair, VOCAB, NATIVE_TOKENS, (7, 14), exact)
