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

from slipstream.kv.blocks import SequenceKV  # noqa: E402
from slipstream.models import build_model  # noqa: E402
from slipstream.models.llama import LlamaModel  # noqa: E402
from slipstream.models.qwen_moe import QwenMoeModel  # noqa: E402
from slipstream.runtime import registry  # noqa: E402
from slipstream.step import StepBuilder  # noqa: E402
from slipstream.weights.gguf import load_gguf  # noqa: E402
from slipstream.weights.moe import MoeLayer  # noqa: E402
from slipstream.weights.safetensors import load_hf  # noqa: E402

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
        cls = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(**BASE, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    config._attn_implementation = "eager"
    model = cls(config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def write_gguf(hf: torch.nn.Module, path: Path, family: str, quant: dict[str, gguf.GGMLQuantizationType],
               extra: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
    """As llama.cpp's converter (experts stacked [E, N, K]); hf gets the file's (dequantized) weights back."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), family)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_count(E)
    w.add_expert_used_count(TOPK)
    w.add_expert_feed_forward_length(FE)
    if family == "qwen2moe":
        w.add_expert_shared_feed_forward_length(FS)
    w.add_vocab_size(c.vocab_size)
    params = {n: p for n, p in hf.named_parameters()}
    state = {n: p.detach().numpy().astype(np.float32) for n, p in params.items()}

    def put(dst: str, arr: np.ndarray, role: str, back: str | None = None) -> torch.Tensor:
        """Write arr as dst; its dequantized values (copied back into HF parameter `back` if given)."""
        qt = quant.get(role, gguf.GGMLQuantizationType.F32)
        if qt == gguf.GGMLQuantizationType.F32 or arr.ndim == 1:
            w.add_tensor(dst, arr)
            return torch.from_numpy(arr)
        raw = gguf.quants.quantize(arr, qt)
        w.add_tensor(dst, raw, raw_dtype=qt)
        deq = torch.from_numpy(gguf.quants.dequantize(raw, qt).reshape(arr.shape).astype(np.float32))
        if back is not None:
            with torch.no_grad():
                params[back].copy_(deq)
        return deq

    put("token_embd.weight", state["model.embed_tokens.weight"], "token_embd", "model.embed_tokens.weight")
    put("output_norm.weight", state["model.norm.weight"], "norm")
    put("output.weight", state["lm_head.weight"], "output", "lm_head.weight")
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for src, dst in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                         ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output")):
            put(b + dst + ".weight", state[p + src + ".weight"], dst, p + src + ".weight")
            if p + src + ".bias" in state:
                w.add_tensor(b + dst + ".bias", state[p + src + ".bias"])
        for src, dst in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                         ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")):
            if p + src + ".weight" in state:
                w.add_tensor(b + dst + ".weight", state[p + src + ".weight"])
        m = p + "mlp."
        if i in c.mlp_only_layers:
            for proj, dst in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                put(b + dst + ".weight", state[m + proj + ".weight"], dst, m + proj + ".weight")
            continue
        w.add_tensor(b + "ffn_gate_inp.weight", state[m + "gate.weight"])
        gate_up, down = state[m + "experts.gate_up_proj"], state[m + "experts.down_proj"]   # [E, 2F, K], [E, K, F]
        g = put(b + "ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :FE]), "ffn_gate_exps")
        u = put(b + "ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, FE:]), "ffn_up_exps")
        put(b + "ffn_down_exps.weight", down, "ffn_down_exps", m + "experts.down_proj")
        with torch.no_grad():
            params[m + "experts.gate_up_proj"].copy_(torch.cat([g, u], dim=1))
        if family == "qwen2moe":
            s = m + "shared_expert."
            for proj, dst in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
                put(b + dst + ".weight", state[s + proj + ".weight"], dst, s + proj + ".weight")
            w.add_tensor(b + "ffn_gate_inp_shexp.weight", state[m + "shared_expert_gate.weight"].reshape(-1))
    if extra is not None:   # more metadata (a tokenizer, for `slipstream inspect`)
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CASES = [(f, fmt) for f in ("qwen2moe", "qwen3moe") for fmt in ("hf", "gguf")]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, QwenMoeModel]:
    family, fmt = request.param
    hf = hf_moe(family, seed=3)
    root = tmp_path_factory.mktemp(family)
    if fmt == "hf":
        hf.save_pretrained(root, safe_serialization=True)
        cfg, weights = load_hf(root)
    else:
        Q = gguf.GGMLQuantizationType
        write_gguf(hf, root / "m.gguf", family, {"token_embd": Q.Q8_0, "attn_q": Q.Q5_0, "ffn_gate_exps": Q.Q8_0,
                                                 "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.Q5_1,
                                                 "ffn_down_shexp": Q.Q8_0, "ffn_up": Q.Q8_0})
        cfg, weights, _ = load_gguf(root / "m.gguf")
    return hf, build_model(cfg, weights)


def run(model, kv, seq: SequenceKV, start: int, toks: list[int], all_rows: bool = False) -> torch.Tensor:
    seq.reserve(start + len(toks))
    b = StepBuilder()
    b.add(seq, toks, start, logits="all" if all_rows else "last")
    return model.forward(b.build(), kv)


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


def test_runtimes_refuse_it(pair):
    _, m = pair
    assert registry.resolve_runtime("auto", m) == "eager"
    for name in ("native", "graph", "megakernel"):
        assert registry.unsupported(name, m) is not None


def test_prefill_chunks_and_decode_match_transformers(pair):
    hf, m = pair
    toks = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()
    kv = m.new_kv_cache(num_blocks=12, block_size=4)
    seq = SequenceKV(kv)
    torch.testing.assert_close(run(m, kv, seq, 0, toks[:9], all_rows=True), ref[:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(run(m, kv, seq, 9, toks[9:14], all_rows=True), ref[9:14], atol=ATOL, rtol=0)
    for p in range(14, 20):
        torch.testing.assert_close(run(m, kv, seq, p, [toks[p]])[0], ref[p], atol=ATOL, rtol=0)


def test_batched_rows_match_alone(pair):
    """Rows of different sequences in one step route independently."""
    _, m = pair
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(10 + n)).tolist() for n in (3, 9, 5)]
    kv = m.new_kv_cache(num_blocks=24, block_size=4)
    alone = torch.stack([run(m, kv, SequenceKV(kv), 0, t)[0] for t in seqs])
    step = StepBuilder()
    for t in seqs:
        s = SequenceKV(kv)
        s.reserve(len(t))
        step.add(s, t, 0, logits="last")
    torch.testing.assert_close(m.forward(step.build(), kv), alone, atol=1e-5, rtol=0)


def test_greedy_matches_generate(pair):
    hf, m = pair
    toks = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        gen = hf.generate(torch.tensor([toks]), max_new_tokens=12, do_sample=False)[0, 5:].tolist()
    kv = m.new_kv_cache(num_blocks=8, block_size=4)
    seq = SequenceKV(kv)
    logits = run(m, kv, seq, 0, toks)
    ours = []
    for i in range(12):
        ours.append(int(logits[0].argmax()))
        logits = run(m, kv, seq, len(toks) + i, [ours[-1]])
    assert ours == gen


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
