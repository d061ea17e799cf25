"""Gemma 2 on the eager runtime against transformers' own Gemma2ForCausalLM, from a Hugging Face
folder and from a GGUF written the way llama.cpp's converter writes it: Gemma 3's layer (GeGLU,
(1 + w) norms before and after attention and MLP, the embedding scaled by sqrt(hidden)) without q/k
norms, every other layer sliding, one RoPE base, and tanh soft-capping of the attention scores and
of the final logits (caps small enough here that the tanh bends)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from support import (  # noqa: E402
    GGUFFromHF,
    check_greedy_matches_generate,
    check_native_step_against,
    forward_chunk,
    hf_and_ours,
    random_hf_model,
)

from slipstream.kv.blocks import SequenceKV  # noqa: E402
from slipstream.models.llama import LlamaModel  # noqa: E402
from slipstream.runtime import registry  # noqa: E402
from slipstream.step import StepBuilder  # noqa: E402

VOCAB = 96
ATOL = 1e-4
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=6,
              query_pre_attn_scalar=16, rms_norm_eps=1e-6, tie_word_embeddings=True,
              attn_logit_softcapping=1.5, final_logit_softcapping=2.5)


def hf_gemma2(seed: int = 0) -> torch.nn.Module:   # norms near 0: Gemma multiplies by (1 + w)
    return random_hf_model(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(**CONFIG), seed, norm=0.0)


HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm":
              "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm":
              "post_ffw_norm"}


def write_gguf(hf: torch.nn.Module, path: Path, quant: dict[str, gguf.GGMLQuantizationType],
               extra: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
    """As llama.cpp's converter: norms stored with the 1 added, the soft-caps and the window as keys;
    `quant` by tensor role. hf gets the file's (dequantized) weights back. `extra` adds metadata (a
    tokenizer, for `slipstream inspect`)."""
    c = hf.config
    f = GGUFFromHF(hf, path, "gemma2", quant)
    f.w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    f.w.add_final_logit_softcapping(c.final_logit_softcapping)
    f.w.add_sliding_window(c.sliding_window)
    f.put_params(HF_TO_GGUF, norm_offset=1.0)
    f.close(extra)


@pytest.fixture(scope="module", params=["hf", "gguf"])
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, LlamaModel]:
    Q = gguf.GGMLQuantizationType
    quant = {"token_embd": Q.Q8_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "ffn_down": Q.Q5_1}
    hf = hf_gemma2(seed=3)
    return hf_and_ours(hf, tmp_path_factory.mktemp("gemma2"), request.param, lambda path: write_gguf(hf, path, quant))


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
    out = forward_chunk(m, kv, seq, 0, toks[:9], all_rows=True)   # prefill, then a chunk after it
    torch.testing.assert_close(out, ref[:9], atol=ATOL, rtol=0)
    out = forward_chunk(m, kv, seq, 9, toks[9:14], all_rows=True)
    torch.testing.assert_close(out, ref[9:14], atol=ATOL, rtol=0)
    for p in range(14, 20):                                        # decode steps
        torch.testing.assert_close(forward_chunk(m, kv, seq, p, [toks[p]])[0], ref[p], atol=ATOL, rtol=0)


def test_batched_rows_match_alone(pair):
    """Two sequences in one step (a prefill beside a decode) give each its own logits."""
    _, m = pair
    a = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(8)).tolist()
    b = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(9)).tolist()
    kv = m.new_kv_cache(num_blocks=16, block_size=4)
    sa, sb = SequenceKV(kv), SequenceKV(kv)
    alone_a = forward_chunk(m, kv, sa, 0, a[:9])
    alone_b = forward_chunk(m, kv, sb, 0, b)
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
    check_greedy_matches_generate(*pair, VOCAB, 14)


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
