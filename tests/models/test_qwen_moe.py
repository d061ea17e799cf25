"""Qwen2-MoE (Qwen1.5-MoE) and Qwen3-MoE on the eager runtime against transformers' own
Qwen2MoeForCausalLM / Qwen3MoeForCausalLM, from a Hugging Face folder and from a GGUF written the way
llama.cpp's converter writes it (stacked ffn_{gate,up,down}_exps, router ffn_gate_inp, Qwen2-MoE's
shared expert ffn_*_shexp behind ffn_gate_inp_shexp). Softmax top-k routing (renormalized for Qwen3-MoE,
as llama.cpp always does for it, not for Qwen2-MoE), q/k/v biases (Qwen2-MoE) or q/k norms (Qwen3-MoE),
and a dense layer among the MoE ones (mlp_only_layers)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from support import GGUFFromHF, check_greedy_matches_generate, forward_chunk, hf_and_ours, random_hf_model  # noqa: E402

from slipstream.kv.blocks import SequenceKV  # noqa: E402
from slipstream.models.llama import LlamaModel  # noqa: E402
from slipstream.models.qwen_moe import QwenMoeModel  # noqa: E402
from slipstream.runtime import registry  # noqa: E402
from slipstream.step import StepBuilder  # noqa: E402
from slipstream.weights.moe import MoeLayer  # noqa: E402

VOCAB = 96
ATOL = 1e-4
E, TOPK, FE, FS = 8, 2, 32, 64
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
            num_experts=E, num_experts_per_tok=TOPK, moe_intermediate_size=FE, mlp_only_layers=[1],
            tie_word_embeddings=False)


def hf_moe(family: str, seed: int = 0) -> torch.nn.Module:
    if family == "qwen2moe":
        config = transformers.Qwen2MoeConfig(**BASE, shared_expert_intermediate_size=FS, norm_topk_prob=False)
        return random_hf_model(transformers.Qwen2MoeForCausalLM, config, seed, bias=0.1)
    config = transformers.Qwen3MoeConfig(**BASE, norm_topk_prob=True)
    return random_hf_model(transformers.Qwen3MoeForCausalLM, config, seed, bias=0.1)


def write_gguf(hf: torch.nn.Module, path: Path, family: str, quant: dict[str, gguf.GGMLQuantizationType],
               extra: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
    """As llama.cpp's converter (experts stacked [E, N, K]); hf gets the file's (dequantized) weights back.
    `extra` adds metadata (a tokenizer, for `slipstream inspect`)."""
    c = hf.config
    f = GGUFFromHF(hf, path, family, quant)
    f.w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    f.w.add_expert_count(E)
    f.w.add_expert_used_count(TOPK)
    f.w.add_expert_feed_forward_length(FE)
    if family == "qwen2moe":
        f.w.add_expert_shared_feed_forward_length(FS)
    state = f.state

    def put(dst: str, src: str) -> None:
        f.put(dst, state[src], back=src)

    put("token_embd.weight", "model.embed_tokens.weight")
    put("output_norm.weight", "model.norm.weight")
    put("output.weight", "lm_head.weight")
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for src, dst in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                         ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output")):
            put(b + dst + ".weight", p + src + ".weight")
            if p + src + ".bias" in state:
                put(b + dst + ".bias", p + src + ".bias")
        for src, dst in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                         ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")):
            if p + src + ".weight" in state:
                put(b + dst + ".weight", p + src + ".weight")
        m = p + "mlp."
        if i in c.mlp_only_layers:
            for proj, dst in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                put(b + dst + ".weight", m + proj + ".weight")
            continue
        put(b + "ffn_gate_inp.weight", m + "gate.weight")
        gate_up = state[m + "experts.gate_up_proj"]   # [E, 2F, K]; down_proj [E, K, F]
        g = f.put(b + "ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :FE]))
        u = f.put(b + "ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, FE:]))
        put(b + "ffn_down_exps.weight", m + "experts.down_proj")
        with torch.no_grad():
            f.params[m + "experts.gate_up_proj"].copy_(torch.cat([g, u], dim=1))
        if family == "qwen2moe":
            s = m + "shared_expert."
            for proj, dst in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"),
                              ("down_proj", "ffn_down_shexp")):
                put(b + dst + ".weight", s + proj + ".weight")
            f.put(b + "ffn_gate_inp_shexp.weight", state[m + "shared_expert_gate.weight"].reshape(-1))
    f.close(extra)


CASES = [(f, fmt) for f in ("qwen2moe", "qwen3moe") for fmt in ("hf", "gguf")]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, QwenMoeModel]:
    family, fmt = request.param
    Q = gguf.GGMLQuantizationType
    quant = {"token_embd": Q.Q8_0, "attn_q": Q.Q5_0, "ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_0,
             "ffn_down_exps": Q.Q5_1, "ffn_down_shexp": Q.Q8_0, "ffn_up": Q.Q8_0}
    hf = hf_moe(family, seed=3)
    return hf_and_ours(hf, tmp_path_factory.mktemp(family), fmt, lambda path: write_gguf(hf, path, family, quant))


def test_config_and_layers(pair):
    hf, m = pair
    c = m.cfg
    assert isinstance(m, QwenMoeModel) and not isinstance(m, LlamaModel)
    assert c.num_experts == E and c.num_experts_per_tok == TOPK and c.moe_intermediate_size == FE
    assert c.moe_layers == (True, False, True)
    assert isinstance(m.layers[0], MoeLayer) and not isinstance(m.layers[1], MoeLayer)
    assert c.norm_topk_prob == (c.architecture == "qwen3moe") and c.qk_norm == (c.architecture == "qwen3moe")
    assert (m.layers[0].shared_gate is not None) == (c.architecture == "qwen2moe")
    assert "mixture-of-experts" in (c.eager_only() or "")


def test_gpu_runtimes_refuse_it_and_native_runs_it(pair):
    _, m = pair
    assert registry.resolve_runtime("auto", m) == "native"
    assert registry.unsupported("native", m) is None   # tested against transformers in tests/runtime/test_cpu_moe.py
    for name in ("graph", "megakernel"):
        assert registry.unsupported(name, m) is not None


def test_prefill_chunks_and_decode_match_transformers(pair):
    hf, m = pair
    toks = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()
    kv = m.new_kv_cache(num_blocks=12, block_size=4)
    seq = SequenceKV(kv)
    torch.testing.assert_close(forward_chunk(m, kv, seq, 0, toks[:9], all_rows=True), ref[:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(forward_chunk(m, kv, seq, 9, toks[9:14], all_rows=True), ref[9:14], atol=ATOL, rtol=0)
    for p in range(14, 20):
        torch.testing.assert_close(forward_chunk(m, kv, seq, p, [toks[p]])[0], ref[p], atol=ATOL, rtol=0)


def test_batched_rows_match_alone(pair):
    """Rows of different sequences in one step route independently."""
    _, m = pair
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(10 + n)).tolist() for n in (3, 9, 5)]
    kv = m.new_kv_cache(num_blocks=24, block_size=4)
    alone = torch.stack([forward_chunk(m, kv, SequenceKV(kv), 0, t)[0] for t in seqs])
    step = StepBuilder()
    for t in seqs:
        s = SequenceKV(kv)
        s.reserve(len(t))
        step.add(s, t, 0, logits="last")
    torch.testing.assert_close(m.forward(step.build(), kv), alone, atol=1e-5, rtol=0)


def test_expert_rows_are_batch_invariant_on_the_exact_eager_step(pair, monkeypatch):
    """On the exact path's eager step (BLAS in fixed row blocks) a 32-token prompt's logits are the same, bit for
    bit, alone and beside four other prompts, though an expert then gets DENSE_FROM_ROWS rows or more (fewer
    alone): an expert's rows take the row kernels whatever their number (quant.routed_rows; with BLAS from 32
    rows on, this changed the prompt's bits), as does the LM head of dense weights, and the shared expert's gate
    is the same whatever the rows beside it (_sigmoid_rows). Dense (Hugging Face) and packed (GGUF) experts."""
    from slipstream.weights import quant
    from slipstream.weights.quant import blas_mode
    _, m = pair
    expert_rows: list[int] = []   # rows of each expert gate/up product
    experts = {id(w) for L in m.layers if isinstance(L, MoeLayer) for w in L.experts_gate_up}   # not the fix's flag
    call = quant.Linear.__call__

    def spy(self, x, *args, **kwargs):
        if id(self) in experts:
            expert_rows.append(x.shape[0])
        return call(self, x, *args, **kwargs)
    monkeypatch.setattr(quant.Linear, "__call__", spy)
    prompts = [torch.randint(0, VOCAB, (32,), generator=torch.Generator().manual_seed(40 + i)).tolist() for i in range(5)]
    kv = m.new_kv_cache(num_blocks=64, block_size=4)

    def run(batch: list[list[int]]) -> torch.Tensor:
        step = StepBuilder()
        for t in batch:
            s = SequenceKV(kv)
            s.reserve(len(t))
            step.add(s, t, 0, logits="last")
        with blas_mode("fp32-fixed"):
            return m.forward(step.build(), kv)

    alone = run(prompts[:1])[0]
    most_alone = max(expert_rows)
    together = run(prompts)
    assert most_alone < quant.DENSE_FROM_ROWS <= max(expert_rows)   # the premise: BLAS's row count is crossed
    assert torch.equal(together[0], alone)


def test_the_shared_gate_of_a_row_does_not_depend_on_the_rows_beside_it():
    """torch.sigmoid over [T, 1] gave some rows other bits for other T (its scalar tail: 56 of 199 T on the
    AVX-512 Xeon); _sigmoid_rows never."""
    from slipstream.models.qwen_moe import _sigmoid_rows
    g = torch.randn(70000, 1, generator=torch.Generator().manual_seed(0)) * 3
    full, plain = _sigmoid_rows(g), torch.sigmoid(g)
    assert torch.allclose(full, plain, rtol=1e-6, atol=0)
    assert all(torch.equal(_sigmoid_rows(g[:t]), full[:t]) for t in range(1, 200))
    threads = torch.get_num_threads()
    torch.set_num_threads(8)   # long inputs: torch's split among threads
    try:
        assert all(torch.equal(_sigmoid_rows(g[:t]), full[:t]) for t in (4097, 33333, 65537, 70000))
    finally:
        torch.set_num_threads(threads)


def test_the_shared_gate_of_no_rows_is_empty():
    """As torch.sigmoid: an empty [0, 1] gate, not an error."""
    from slipstream.models.qwen_moe import _sigmoid_rows
    out = _sigmoid_rows(torch.empty(0, 1))
    assert out.shape == (0, 1) and out.dtype == torch.float32


def test_greedy_matches_generate(pair):
    check_greedy_matches_generate(*pair, VOCAB, 12)


def test_tensor_parallelism_refuses_it(pair):
    from slipstream.distributed.tensor_parallel import _shard_llama
    from slipstream.errors import SlipstreamError
    with pytest.raises(SlipstreamError, match="MoE"):
        _shard_llama(pair[1], 2, 0)


def test_transformers_v4_configs():
    """Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B config.json as transformers 4.x wrote them."""
    from slipstream.config import ModelConfig
    q2 = ModelConfig.from_hf(dict(
        model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, rope_theta=1000000.0, decoder_sparse_step=1,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60,
        norm_topk_prob=False, mlp_only_layers=[], use_sliding_window=False, sliding_window=32768))
    assert q2.architecture == "qwen2moe" and q2.attention_bias and not q2.qk_norm and q2.num_experts == 60
    assert q2.shared_expert_intermediate_size == 5632 and all(q2.moe_layers) and not q2.norm_topk_prob
    q3 = ModelConfig.from_hf(dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1000000.0, decoder_sparse_step=1,
        moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128, norm_topk_prob=True, mlp_only_layers=[],
        attention_bias=False, tie_word_embeddings=False))
    assert q3.architecture == "qwen3moe" and q3.qk_norm and not q3.attention_bias and q3.head_dim == 128
    assert q3.num_experts_per_tok == 8 and q3.norm_topk_prob and q3.shared_expert_intermediate_size == 0
