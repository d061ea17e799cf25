"""What the tensor-parallel test runs in each of its ranks (spawned processes): tiny random models
(Llama, Qwen3, Gemma 3, Gemma 2, Phi-3, DeepSeek-V3, DeepSeek-V3.2, GLM-4.5 MoE), built the same way
on every rank from one seed, and the comparison rank 0 makes between the model and its sharded version
(rank 0 drives an `Engine`; the other ranks follow)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

VOCAB = 128


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mat(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Weights scaled by 1/sqrt(fan-in): logits of order 1, so greedy choices are not near-ties."""
    return torch.randn(*shape, generator=g) / shape[-1] ** 0.5


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.2 * torch.randn(n, generator=g)


def tiny_llama(kind: str, seed: int = 0) -> Any:
    from slipstream.config import ModelConfig
    from slipstream.models.llama import LlamaModel
    from slipstream.weights.layers import LlamaLayer
    from slipstream.weights.quant import Linear

    qwen3 = kind == "qwen3"
    cfg = ModelConfig(architecture="qwen3" if qwen3 else "llama", vocab_size=VOCAB, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=24 if qwen3 else 16, intermediate_size=96,
                      rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=not qwen3, qk_norm=qwen3)
    g = _g(seed)
    H, KVH, D, Hd, Fd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    w: dict[str, Any] = {"embed": Linear.dense(_mat(g, VOCAB, Hd)), "norm": _norm(g, Hd)}
    w["lm_head"] = w["embed"] if cfg.tie_word_embeddings else Linear.dense(_mat(g, VOCAB, Hd))
    for i in range(cfg.num_layers):
        w[f"layers.{i}"] = LlamaLayer(
            attn_norm=_norm(g, Hd), ffn_norm=_norm(g, Hd), qkv=Linear.dense(_mat(g, (H + 2 * KVH) * D, Hd)),
            o=Linear.dense(_mat(g, Hd, H * D)), gate_up=Linear.dense(_mat(g, 2 * Fd, Hd)),
            down=Linear.dense(_mat(g, Hd, Fd)), q_norm=_norm(g, D) if qwen3 else None,
            k_norm=_norm(g, D) if qwen3 else None)
    return LlamaModel(cfg, w)


def tiny_deepseek(kind: str, seed: int = 0) -> Any:
    from slipstream.config import DeepseekConfig
    from slipstream.models.deepseek import DeepseekModel
    from slipstream.weights.deepseek import DeepseekLayer, DeepseekMoe, DenseMlp, GqaAttention, Indexer, MlaAttention

    common = dict(vocab_size=VOCAB, hidden_size=64, num_layers=3, num_heads=4, intermediate_size=96,
                  moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
                  mlp_layer_types=["dense", "sparse", "sparse"], rms_norm_eps=1e-6, max_position_embeddings=512)
    if kind in ("deepseek_v3", "deepseek_v32"):
        dsa = dict(index_topk=6, index_head_dim=16, index_n_heads=16, indexer_types=["full"] * 3) \
            if kind == "deepseek_v32" else {}
        cfg = DeepseekConfig(architecture=kind, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                             attention="mla", q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=12, **dsa, **common)
    else:   # GLM-4.5 MoE: GQA with biases, q/k norm, partial rotary
        cfg = DeepseekConfig(architecture="glm4_moe", routed_scaling_factor=1.5, attention="gqa", num_kv_heads=2,
                             head_dim=16, partial_rotary_factor=0.5, attention_bias=True, qk_norm=True, **common)
    g = _g(seed)
    Hd, H = cfg.hidden_size, cfg.num_heads

    def mlp(f: int) -> DenseMlp:
        return DenseMlp(_mat(g, 2 * f, Hd), _mat(g, Hd, f))

    w: dict[str, Any] = {"embed": _mat(g, VOCAB, Hd), "norm": _norm(g, Hd), "lm_head": _mat(g, VOCAB, Hd)}
    for i, kind_i in enumerate(cfg.mlp_layer_types):
        attn_norm, ffn_norm = _norm(g, Hd), _norm(g, Hd)
        attn: MlaAttention | GqaAttention
        if cfg.attention == "mla":
            dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
            q_a, q_a_norm = _mat(g, cfg.q_lora_rank, Hd), _norm(g, cfg.q_lora_rank)
            q_b, kv_a, kv_a_norm = _mat(g, H * (dn + dr), cfg.q_lora_rank), _mat(g, r + dr, Hd), _norm(g, r)
            w_uk, w_uv = MlaAttention.split_kv_b(_mat(g, H * (dn + dv), r), H, dn, dv)
            attn = MlaAttention(kv_a=kv_a, kv_a_norm=kv_a_norm, w_uk=w_uk, w_uv=w_uv, o=_mat(g, Hd, H * dv),
                                q_a=q_a, q_a_norm=q_a_norm, q_b=q_b)
            if cfg.dsa:   # DeepSeek Sparse Attention's lightning indexer
                Hi, Di = cfg.index_n_heads, cfg.index_head_dim
                attn.indexer = Indexer(wq_b=_mat(g, Hi * Di, cfg.q_lora_rank), wk=_mat(g, Di, Hd),
                                       k_norm=_norm(g, Di), k_norm_bias=0.2 * torch.randn(Di, generator=g),
                                       weights_proj=_mat(g, Hi, Hd))
        else:
            D, KVH = cfg.head_dim, cfg.num_kv_heads
            attn = GqaAttention.fuse(
                q=_mat(g, H * D, Hd), k=_mat(g, KVH * D, Hd), v=_mat(g, KVH * D, Hd),
                q_bias=0.2 * torch.randn(H * D, generator=g), k_bias=0.2 * torch.randn(KVH * D, generator=g),
                v_bias=0.2 * torch.randn(KVH * D, generator=g), q_norm=_norm(g, D), k_norm=_norm(g, D),
                o=_mat(g, Hd, H * D))
        ffn: DenseMlp | DeepseekMoe
        if kind_i == "dense":
            ffn = mlp(cfg.intermediate_size)
        else:
            f, E = cfg.moe_intermediate_size, cfg.n_routed_experts
            experts = [mlp(f) for _ in range(E)]
            router, bias = _mat(g, E, Hd), 0.2 * torch.randn(E, generator=g)
            ffn = DeepseekMoe.stack(router, bias, experts, mlp(f))
        w[f"layers.{i}"] = DeepseekLayer(attn_norm, ffn_norm, attn, ffn)
    return DeepseekModel(cfg, w)


def _hf_config(kind: str) -> dict[str, Any]:
    """Hugging Face configs of tiny Gemma 3, Gemma 2 and Phi-3 models with every feature their eager
    step has: Gemma's GeGLU, (1 + w) post-norms, scaled embedding, attention scale, sliding windows
    (6 tokens, shorter than the prompts), Gemma 3's local RoPE base and q/k norms, Gemma 2's attention
    and final soft-capping; Phi-3's LongRoPE (the first prompt outgrows the original 16 positions and
    takes the long factors, the second keeps the short ones) over half of each head (partial rotary)."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512)
    if kind == "gemma3":
        return dict(base, model_type="gemma3_text", num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"], rope_theta=1e6,
                    rope_local_base_freq=1e4, tie_word_embeddings=True)
    if kind == "gemma2":
        return dict(base, model_type="gemma2", num_hidden_layers=4, sliding_window=6, query_pre_attn_scalar=24,
                    attn_logit_softcapping=1.5, final_logit_softcapping=2.5, tie_word_embeddings=True)
    g = _g(1)
    return dict(base, model_type="phi3", num_hidden_layers=3, max_position_embeddings=64, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                     original_max_position_embeddings=16,
                                     short_factor=(1.0 + torch.rand(4, generator=g)).tolist(),
                                     long_factor=(1.0 + 8 * torch.rand(4, generator=g)).tolist()))


def tiny_dense(kind: str, seed: int = 0) -> Any:
    """A random `LlamaModel` of the Gemma 3, Gemma 2 or Phi-3 config above (norms as loaded: Gemma's
    with the 1 added, near 1)."""
    from slipstream.config import ModelConfig
    from slipstream.models.llama import LlamaModel
    from slipstream.weights.layers import LlamaLayer
    from slipstream.weights.quant import Linear

    cfg = ModelConfig.from_hf(_hf_config(kind))
    assert cfg.eager_only() is not None, kind   # the features a plain Llama step lacks
    g = _g(seed)
    H, KVH, D, Hd, Fd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    w: dict[str, Any] = {"embed": Linear.dense(_mat(g, VOCAB, Hd)), "norm": _norm(g, Hd)}
    w["lm_head"] = w["embed"] if cfg.tie_word_embeddings else Linear.dense(_mat(g, VOCAB, Hd))
    sandwich = cfg.sandwich_norms
    for i in range(cfg.num_layers):
        w[f"layers.{i}"] = LlamaLayer(
            attn_norm=_norm(g, Hd), ffn_norm=_norm(g, Hd), qkv=Linear.dense(_mat(g, (H + 2 * KVH) * D, Hd)),
            o=Linear.dense(_mat(g, Hd, H * D)), gate_up=Linear.dense(_mat(g, 2 * Fd, Hd)),
            down=Linear.dense(_mat(g, Hd, Fd)), q_norm=_norm(g, D) if cfg.qk_norm else None,
            k_norm=_norm(g, D) if cfg.qk_norm else None, post_attn_norm=_norm(g, Hd) if sandwich else None,
            post_ffn_norm=_norm(g, Hd) if sandwich else None)
    return LlamaModel(cfg, w)


BUILDERS = {"llama": tiny_llama, "qwen3": tiny_llama, "gemma3": tiny_dense, "gemma2": tiny_dense, "phi3": tiny_dense,
            "deepseek_v3": tiny_deepseek, "deepseek_v32": tiny_deepseek, "glm4_moe": tiny_deepseek}


class _Detok:
    def add(self, token_id: int) -> str:
        return ""

    def add_many(self, ids: Any) -> str:
        return ""

    def flush(self) -> str:
        return ""


class StubTokenizer:
    """The engine detokenizes its output; these tests compare token ids only."""
    eos_token_ids: tuple[int, ...] = ()

    def detokenizer(self, skip_special_tokens: bool = True) -> _Detok:
        return _Detok()


def greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt, batched by an `Engine` (eager runtime) over `model`."""
    from slipstream.engine.config import EngineConfig
    from slipstream.engine.engine import Engine
    from slipstream.engine.request import Request
    from slipstream.engine.sampling import SamplingParams

    eng = Engine(model, StubTokenizer(), EngineConfig(runtime="eager", kv_cache_tokens=512, prefill_chunk=8,
                                                      max_batch=4))
    reqs = [Request(list(p), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)) for p in prompts]
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished():
        eng.step()
    return [r.output_ids for r in reqs]


def step_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    """Logits of every position of `prompt` as one prefill step, then of one decode step."""
    from slipstream.kv.blocks import SequenceKV
    from slipstream.step import prefill_step

    kv = model.new_kv_cache(8, 16)
    seq = SequenceKV(kv)
    seq.reserve(len(prompt) + 1)
    a = model.forward(prefill_step(seq, prompt, logits="all"), kv)
    b = model.forward(prefill_step(seq, [int(a[-1].argmax())], start=len(prompt)), kv)
    return torch.cat([a, b])


def run(rank: int, world: int, init_file: str, names: list[str], out: str) -> None:
    """One rank: shard each model; rank 0 compares, the others follow."""
    from slipstream.distributed.tensor_parallel import Collectives, ShardedModel, TensorParallelModel, follow

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    prompts = [[(7 * i + 3) % VOCAB for i in range(21)], [(11 * i + 5) % VOCAB for i in range(9)]]
    try:
        for name in names:
            full = BUILDERS[name](name)
            shard = ShardedModel(full, Collectives())
            if rank != 0:
                follow(shard)
                continue
            tp = TensorParallelModel(shard)
            results[name] = {"ref_logits": step_logits(full, prompts[0]), "tp_logits": step_logits(tp, prompts[0]),
                             "ref_tokens": greedy(full, prompts, 16), "tp_tokens": greedy(tp, prompts, 16)}
            tp.stop()
    finally:
        if rank == 0:
            torch.save(results, out)
        dist.destroy_process_group()


def write_hf_llama(folder: Any, seed: int = 0) -> None:
    """`tiny_llama("llama")` as a Hugging Face folder (config.json, model.safetensors, a word-level
    tokenizer.json over "w0".."w127"), for the CLI to load."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    m = tiny_llama("llama", seed)
    c = m.cfg
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
    state = {"model.embed_tokens.weight": m.embed.data, "model.norm.weight": m.norm}
    for i, L in enumerate(m.layers):
        p = f"model.layers.{i}."
        qkv, gu = L.qkv.data, L.gate_up.data
        state.update({p + "self_attn.q_proj.weight": qkv[:H * D],
                      p + "self_attn.k_proj.weight": qkv[H * D:(H + KVH) * D],
                      p + "self_attn.v_proj.weight": qkv[(H + KVH) * D:], p + "self_attn.o_proj.weight": L.o.data,
                      p + "mlp.gate_proj.weight": gu[:c.intermediate_size],
                      p + "mlp.up_proj.weight": gu[c.intermediate_size:], p + "mlp.down_proj.weight": L.down.data,
                      p + "input_layernorm.weight": L.attn_norm, p + "post_attention_layernorm.weight": L.ffn_norm})
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": H,
        "num_key_value_heads": KVH, "head_dim": D, "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": True, "rope_theta": c.rope_theta, "hidden_act": "silu"}))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
