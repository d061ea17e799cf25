"""Phi-3 / Phi-3.5 / Phi-4-mini on the eager runtime against transformers' own Phi3ForCausalLM, from a
Hugging Face folder and from a GGUF written the way llama.cpp's converter writes it (fused attn_qkv,
ffn_up holding gate then up, rope_factors_short/long tensors, the attention factor as a key).

LongRoPE: the short factors while a sequence is at most original_max_position_embeddings (16 here)
long, the long ones once it is longer, cos/sin scaled by sqrt(1 + ln(64/16) / ln(16)). transformers
picks the set by the length a forward call reaches, and its generate() recomputes the whole cache
with the long factors on the step that crosses the boundary; a paged cache keeps the keys it has
(as llama.cpp does, which picks the set once per context size), so the checks below stay on one side
of the boundary per sequence: short sequences throughout, or a prefill that is already long."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
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
from slipstream.models import build_model  # noqa: E402
from slipstream.models.llama import LlamaModel  # noqa: E402
from slipstream.runtime import registry  # noqa: E402
from slipstream.step import StepBuilder  # noqa: E402
from slipstream.weights.gguf import load_gguf  # noqa: E402

VOCAB = 96
ATOL = 1e-4
ORIG = 16


def phi_config(partial: float, tied: bool, longrope: bool = True, window: int | None = None) -> transformers.Phi3Config:
    rd = int(16 * partial)
    g = torch.Generator().manual_seed(1)
    rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=partial,
                short_factor=(1.0 + torch.rand(rd // 2, generator=g)).tolist(),
                long_factor=(1.0 + 8 * torch.rand(rd // 2, generator=g)).tolist())
    if not longrope:
        rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=partial)
    return transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   original_max_position_embeddings=ORIG, rope_parameters=rope,
                                   tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                   sliding_window=window)


def hf_phi3(partial: float, tied: bool, seed: int = 0, longrope: bool = True,
            window: int | None = None) -> torch.nn.Module:
    return random_hf_model(transformers.Phi3ForCausalLM, phi_config(partial, tied, longrope, window), seed)


HF_TO_GGUF = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(hf: torch.nn.Module, path: Path, quant: dict[str, gguf.GGMLQuantizationType],
               extra: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
    """As llama.cpp's Phi3MiniModel converter; hf gets the file's (dequantized) weights back. `extra`
    adds metadata (a tokenizer, for `slipstream inspect`)."""
    import math
    c = hf.config
    rope = c.rope_parameters
    head_dim = c.hidden_size // c.num_attention_heads
    f = GGUFFromHF(hf, path, "phi3", quant, head_dims=False)
    w = f.w
    w.add_rope_scaling_orig_ctx_len(ORIG)
    w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.sliding_window or 0)   # as the converter: 0 when the config has none
    if rope["rope_type"] == "longrope":
        scale = c.max_position_embeddings / ORIG
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIG)))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    f.put_params(HF_TO_GGUF)
    f.close(extra)


# (format, partial rotary factor, tied embeddings): Phi-3.5-mini-like and Phi-4-mini-like
CASES = [("hf", 1.0, False), ("gguf", 1.0, False), ("hf", 0.75, True), ("gguf", 0.75, True)]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-rot{p[1]}")
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, LlamaModel]:
    fmt, partial, tied = request.param
    Q = gguf.GGMLQuantizationType
    quant = {"token_embd": Q.Q8_0, "attn_qkv": Q.Q5_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1}
    hf = hf_phi3(partial, tied, seed=3)
    return hf_and_ours(hf, tmp_path_factory.mktemp("phi3"), fmt, lambda path: write_gguf(hf, path, quant))


def test_config(pair):
    hf, m = pair
    c = m.cfg
    partial = hf.config.rope_parameters["partial_rotary_factor"]
    assert c.architecture == "phi3" and c.rope_scaling["rope_type"] == "longrope"
    assert c.rope_dim == int(16 * partial) and m.longrope is not None
    assert m.longrope.amp == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-6)
    assert "longrope RoPE scaling" in (c.eager_only() or "")
    if partial != 1.0:
        assert "partial rotary" in (c.eager_only() or "")


def test_the_gpu_runtimes_refuse_it_and_native_runs_it(pair):
    _, m = pair
    assert isinstance(m, LlamaModel)
    assert registry.unsupported("native", m) is None      # tested against transformers below
    for name in ("graph", "megakernel"):
        assert "the eager runtime does" in (registry.unsupported(name, m) or "")


def test_short_sequence_prefill_chunks_and_decode(pair):
    hf, m = pair
    toks = torch.randint(0, VOCAB, (ORIG,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()   # 16 tokens: the short factors
    kv = m.new_kv_cache(num_blocks=12, block_size=4)
    seq = SequenceKV(kv)
    torch.testing.assert_close(forward_chunk(m, kv, seq, 0, toks[:7], all_rows=True), ref[:7], atol=ATOL, rtol=0)
    torch.testing.assert_close(forward_chunk(m, kv, seq, 7, toks[7:12], all_rows=True), ref[7:12], atol=ATOL, rtol=0)
    for p in range(12, ORIG):
        torch.testing.assert_close(forward_chunk(m, kv, seq, p, [toks[p]])[0], ref[p], atol=ATOL, rtol=0)


def test_long_sequence_uses_the_long_factors(pair):
    hf, m = pair
    toks = torch.randint(0, VOCAB, (28,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()   # 28 > 16 tokens: the long factors
        short = hf(torch.tensor([toks[:ORIG]])).logits[0].float()
    assert (ref[:ORIG] - short).abs().max() > 1e-2           # the two sets differ enough to tell apart
    kv = m.new_kv_cache(num_blocks=12, block_size=4)
    seq = SequenceKV(kv)
    torch.testing.assert_close(forward_chunk(m, kv, seq, 0, toks[:20], all_rows=True), ref[:20], atol=ATOL, rtol=0)
    torch.testing.assert_close(forward_chunk(m, kv, seq, 20, toks[20:24], all_rows=True), ref[20:24], atol=ATOL, rtol=0)
    for p in range(24, 28):
        torch.testing.assert_close(forward_chunk(m, kv, seq, p, [toks[p]])[0], ref[p], atol=ATOL, rtol=0)


def test_batched_short_and_long_sequences(pair):
    """One step holding a short and a long sequence: each row rotates with its own sequence's factors."""
    _, m = pair
    a = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8)).tolist()
    b = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    kv = m.new_kv_cache(num_blocks=16, block_size=4)
    alone = [forward_chunk(m, kv, SequenceKV(kv), 0, t)[0] for t in (a, b)]
    sa, sb = SequenceKV(kv), SequenceKV(kv)
    sa.reserve(len(a))
    sb.reserve(len(b))
    step = StepBuilder()
    step.add(sa, a, 0, logits="last")
    step.add(sb, b, 0, logits="last")
    both = m.forward(step.build(), kv)
    torch.testing.assert_close(both, torch.stack(alone), atol=1e-5, rtol=0)


def test_greedy_matches_generate(pair):
    check_greedy_matches_generate(*pair, VOCAB, ORIG - 5)   # within the short factors (see the module's docstring)


def test_plain_phi3_runs_on_the_native_runtime(tmp_path):
    """Phi-3 without rope scaling, partial rotary or a window (Phi-3-mini-4k less its window) is a plain
    Llama step over fused weights: a LlamaModel, which the native runtime takes and computes as the
    eager step does (and the eager step as transformers does)."""
    from support import decode_step, prefill_step

    from slipstream.config import ModelConfig
    from slipstream.kernels.cpu import load_library
    cfg = ModelConfig.from_hf(dict(model_type="phi3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=4096, rope_theta=10000.0, sliding_window=None))
    assert cfg.architecture == "phi3" and cfg.eager_only() is None and cfg.rope_scaling is None
    hf = hf_phi3(1.0, False, seed=4, longrope=False)
    write_gguf(hf, tmp_path / "plain.gguf", {})
    cfg, weights, _ = load_gguf(tmp_path / "plain.gguf")
    m = build_model(cfg, weights)
    assert isinstance(m, LlamaModel) and cfg.eager_only() is None
    toks = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()
    kv = m.new_kv_cache(num_blocks=8, block_size=4)
    torch.testing.assert_close(forward_chunk(m, kv, SequenceKV(kv), 0, toks, all_rows=True), ref, atol=ATOL, rtol=0)
    if load_library() is None:
        pytest.skip("native CPU kernels unavailable")
    from slipstream.runtime.cpu_team import CpuTeamDecoder
    assert registry.resolve_runtime("auto", m) == "native"
    kv_e, kv_t = m.new_kv_cache(16), m.new_kv_cache(16)
    team = CpuTeamDecoder(m, kv_t, exact=True)
    se, st = SequenceKV(kv_e), SequenceKV(kv_t)
    m.forward(prefill_step(se, toks[:8], extra=8), kv_e)
    m.forward(prefill_step(st, toks[:8], extra=8), kv_t)
    for p in range(8, 12):
        le = m.forward(decode_step([se], [toks[p]], [p]), kv_e)
        lt = team.forward(decode_step([st], [toks[p]], [p]))
        torch.testing.assert_close(lt, le, atol=ATOL, rtol=0)
        torch.testing.assert_close(le[0], ref[p], atol=ATOL, rtol=0)
    windowed = ModelConfig.from_hf(dict(model_type="phi3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4, sliding_window=2047))
    assert windowed.layer_types == ("sliding", "sliding") and "sliding" in (windowed.eager_only() or "")


def test_transformers_v4_configs():
    """Phi-3.5-mini and Phi-4-mini config.json as transformers 4.x wrote them (rope_scaling of type
    longrope, partial_rotary_factor at the top)."""
    import math

    from slipstream.config import ModelConfig
    from slipstream.models.llama import LongRope
    base = dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072,
                original_max_position_embeddings=4096, rope_theta=10000.0, sliding_window=262144)
    c = ModelConfig.from_hf(dict(base, rope_scaling=dict(type="longrope", short_factor=[1.0] * 48,
                                                         long_factor=[2.0] * 48)))
    assert c.rope_scaling["rope_type"] == "longrope" and c.rope_dim == 96 and c.rotary_dim is None
    amp = LongRope(c).amp
    assert amp == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    c4 = ModelConfig.from_hf(dict(base, hidden_size=3072, num_attention_heads=24, num_key_value_heads=8,
                                  partial_rotary_factor=0.75, tie_word_embeddings=True, sliding_window=None,
                                  rope_scaling=dict(type="longrope", short_factor=[1.0] * 48, long_factor=[2.0] * 48)))
    assert c4.head_dim == 128 and c4.rotary_dim == 96 and c4.layer_types is None and c4.tie_word_embeddings


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_a_sliding_window_masks_every_layer(tmp_path, fmt):
    """Phi-3-mini-4k's sliding_window (2047 there, 5 here) limits every layer's attention, as transformers
    computes it; the step is then eager-only."""
    hf = hf_phi3(1.0, False, seed=8, longrope=False, window=5)
    quant = {"attn_qkv": gguf.GGMLQuantizationType.Q8_0}
    _, m = hf_and_ours(hf, tmp_path, fmt, lambda path: write_gguf(hf, path, quant))
    cfg = m.cfg
    assert cfg.layer_types == ("sliding",) * 3 and cfg.sliding_window == 5 and isinstance(m, LlamaModel)
    toks = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()
        full = hf_phi3(1.0, False, seed=8, longrope=False)
        full.load_state_dict(hf.state_dict())
        unwindowed = full(torch.tensor([toks])).logits[0].float()
    assert (ref[6:] - unwindowed[6:]).abs().max() > 1e-2          # the window matters here
    kv = m.new_kv_cache(num_blocks=8, block_size=4)
    seq = SequenceKV(kv)
    torch.testing.assert_close(forward_chunk(m, kv, seq, 0, toks[:8], all_rows=True), ref[:8], atol=ATOL, rtol=0)
    for p in range(8, 14):
        torch.testing.assert_close(forward_chunk(m, kv, seq, p, [toks[p]])[0], ref[p], atol=ATOL, rtol=0)


NATIVE_TOKENS = 14

@pytest.mark.parametrize("exact", [True, False])
def test_native_step_matches_transformers(pair, exact):
    """The native CPU step (runtime/cpu_team.py) on this family: prompt chunks as rows of the step,
    then decode rows; exact path within float32 noise of transformers, fast path (int8 activations)
    close, choosing the same tokens up to near ties."""
    check_native_step_against(*pair, VOCAB, NATIVE_TOKENS, (4, 8), exact)
