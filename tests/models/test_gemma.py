"""Gemma 3 (text) on the eager runtime against transformers' own Gemma3ForCausalLM, from a Hugging
Face folder and from a GGUF written the way llama.cpp's converter writes it: GeGLU (tanh GELU),
(1 + w) norms before and after attention and MLP, the embedding scaled by sqrt(hidden), q/k norms,
query_pre_attn_scalar, interleaved sliding-window and global layers with their own RoPE bases."""
from __future__ import annotations

from pathlib import Path

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

VOCAB = 96
ATOL = 1e-4
# as Gemma 3 itself: five sliding-window layers, then a global one (llama.cpp's GGUFs assume it)
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=6,
              layer_types=LAYER_TYPES, query_pre_attn_scalar=16, rms_norm_eps=1e-6, tie_word_embeddings=True)


def hf_gemma(seed: int = 0) -> torch.nn.Module:   # norms near 0: Gemma multiplies by (1 + w)
    return random_hf_model(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**CONFIG), seed, norm=0.0)


HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm":
              "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm":
              "post_ffw_norm", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_gguf(hf: torch.nn.Module, path: Path, quant: dict[str, gguf.GGMLQuantizationType]) -> None:
    """As llama.cpp's converter: norms stored with the 1 added; `quant` by tensor role. hf gets the
    file's (dequantized) weights back so that both compute on the same numbers."""
    f = GGUFFromHF(hf, path, "gemma3", quant)
    f.w.add_rope_freq_base(1e6)
    f.w.add_sliding_window(hf.config.sliding_window)
    f.put_params(HF_TO_GGUF, norm_offset=1.0)
    f.close()


@pytest.fixture(scope="module", params=["hf", "gguf"])
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, LlamaModel]:
    Q = gguf.GGMLQuantizationType
    quant = {"token_embd": Q.Q8_0, "attn_q": Q.Q5_0, "attn_v": Q.Q5_1, "ffn_up": Q.Q8_0}
    hf = hf_gemma(seed=3)
    return hf_and_ours(hf, tmp_path_factory.mktemp("gemma"), request.param, lambda path: write_gguf(hf, path, quant))


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
    out = forward_chunk(m, kv, seq, 0, toks[:9], all_rows=True)   # prefill, then a chunk after it
    torch.testing.assert_close(out, ref[:9], atol=ATOL, rtol=0)
    out = forward_chunk(m, kv, seq, 9, toks[9:14], all_rows=True)
    torch.testing.assert_close(out, ref[9:14], atol=ATOL, rtol=0)
    for p in range(14, 20):                                        # decode steps
        torch.testing.assert_close(forward_chunk(m, kv, seq, p, [toks[p]])[0], ref[p], atol=ATOL, rtol=0)


def test_greedy_matches_generate(pair):
    check_greedy_matches_generate(*pair, VOCAB, 14)


@pytest.mark.parametrize("exact", [True, False])
def test_native_step_matches_transformers(pair, exact):
    """The native CPU step (runtime/cpu_team.py) on Gemma 3: GELU GLU, post-norms through their own tasks,
    the scaled embedding, sliding-window layers with the local RoPE base; prompt chunks past the window
    as rows of the step, then decode rows. Exact path within float32 noise of transformers; the fast
    path (int8 activations) close, choosing the same tokens up to near ties."""
    check_native_step_against(*pair, VOCAB, 20, (9, 14), exact, num_blocks=12)


def test_native_step_over_an_int8_cache(pair):
    """The fast path over an int8 KV cache on Gemma 3's hybrid cache (the sliding layers' parts keep scale
    planes of their own): as close to transformers as the fast path's own tolerance, the same near-tie rule."""
    check_native_step_against(*pair, VOCAB, 20, (9, 14), False, num_blocks=12, kv_dtype=torch.int8)
