"""The DeepSeek / GLM family (DeepSeek-V3, GLM-4.5 MoE, DeepSeek-V3.2, GLM-5) against transformers.

Each tiny model (3 layers, the first dense, hidden 64, 8 routed experts in 2 groups) is built by
transformers' own class with every parameter re-drawn (so biases, norm weights and the routing
correction bias are not trivial), saved as safetensors with a word-level tokenizer.json, loaded by
Slipstream and compared in float32 with transformers on the same weights:
  * last-position / every-position logits within ATOL = 1e-4 (logits are of order 1-5);
  * chunked prefill then decode through the paged cache (absorbed MLA at decode) against the full
    forward; the absorbed and expanded MLA forms against each other (1e-5);
  * 32 greedy tokens through `slipstream.LLM` (the engine, its scheduler and paged cache) for a batch
    of two different prompts, equal to `generate(do_sample=False)` of each prompt;
  * DSA with index_topk smaller than the context, so that the selection changes the result;
  * FP8 block-scaled checkpoints dequantized at load; MTP layers against their equations.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from slipstream import LLM, SamplingParams  # noqa: E402
from slipstream.config import DeepseekConfig  # noqa: E402
from slipstream.kv.blocks import LatentKVCache, PagedKVCache, SequenceKV  # noqa: E402
from slipstream.models import build_model  # noqa: E402
from slipstream.models.deepseek import DeepseekModel  # noqa: E402
from slipstream.step import StepBuilder, prefill_step  # noqa: E402
from slipstream.weights.safetensors import load_hf  # noqa: E402
from slipstream.errors import SlipstreamError  # noqa: E402

VOCAB = 128
ATOL = 1e-4

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, n_shared_experts=1,
              num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=1,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=12)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
DSA = dict(index_topk=6, index_head_dim=16, index_n_heads=16)

VARIANTS = {
    # MLA with a q latent, grouped routing, 2.5x routed scaling
    "v3": ("deepseek_v3", {**MLA, "routed_scaling_factor": 2.5}),
    # plain q_proj, YaRN (mscale != mscale_all_dim: cos/sin amplitude and softmax correction)
    "v3_noqlora_yarn": ("deepseek_v3", {**MLA, "q_lora_rank": None, "rope_parameters": YARN,
                                        "norm_topk_prob": False}),
    # GQA with biases, q/k norm, partial rotary 0.5, one expert group
    "glm4_moe": ("glm4_moe", dict(num_key_value_heads=2, head_dim=16, use_qk_norm=True,
                                  attention_bias=True, n_group=1, topk_group=1,
                                  routed_scaling_factor=1.5)),
    "v32": ("deepseek_v32", {**MLA, **DSA}),
    "glm5": ("glm_moe_dsa", {**MLA, **DSA, "mlp_layer_types": ["dense", "sparse", "sparse"],
                             "indexer_types": ["full", "shared", "full"], "head_dim": 8}),
}
HF_CLASSES = {"deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe", "deepseek_v32": "DeepseekV32",
              "glm_moe_dsa": "GlmMoeDsa"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (transformers' expert loop's index_add_
    is ~100x slower with 2 threads than with 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@dataclass
class Tiny:
    name: str
    folder: Path
    hf: torch.nn.Module
    cfg: DeepseekConfig
    model: DeepseekModel


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):   # incl. e_score_correction_bias
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:  # logits of order 1 so that greedy choices are not decided by rounding noise
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def hf_model(model_type: str, extra: dict, seed: int) -> torch.nn.Module:
    prefix = HF_CLASSES[model_type]
    config = getattr(transformers, prefix + "Config")(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, prefix + "ForCausalLM")(config).to(torch.float32).eval()
    _randomize(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over "w0".."w127" (the tests drive the model with token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory) -> Tiny:
    name = request.param
    model_type, extra = VARIANTS[name]
    hf = hf_model(model_type, extra, seed=sorted(VARIANTS).index(name))
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    cfg, weights = load_hf(folder)
    model = build_model(cfg, weights)
    assert isinstance(model, DeepseekModel)
    return Tiny(name, folder, hf, cfg, model)


# -- helpers ------------------------------------------------------------------------------------

def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def run_step(model, kv, parts: list[tuple[SequenceKV, int, list[int]]], gather: bool = False,
             all_rows: bool = False, **kw):
    """One step over several sequences: (seq, tokens already cached, new tokens) each."""
    b = StepBuilder()
    for seq, start, toks in parts:
        seq.reserve(start + len(toks))
        b.add(seq, toks, start, logits="all" if all_rows else "last", gather=gather)
    return model.forward(b.build(), kv, **kw)


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    diff = (a - b).abs().max().item()
    assert diff < atol, f"max abs diff {diff:.3g} (logits scale {b.abs().max().item():.3g})"


def is_mla(t: Tiny) -> bool:
    return t.cfg.attention == "mla"


# -- config and rope ----------------------------------------------------------------------------

def test_config_matches_hf(tiny: Tiny):
    c, h = tiny.cfg, tiny.hf.config
    assert c.architecture == h.model_type
    assert (c.num_layers, c.vocab_size, c.hidden_size) == (3, VOCAB, 64)
    assert c.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert c.n_routed_experts == 8 and c.num_experts_per_tok == 3
    assert c.routed_scaling_factor == h.routed_scaling_factor
    assert c.norm_topk_prob == h.norm_topk_prob
    if tiny.name == "glm4_moe":
        assert c.attention == "gqa" and c.qk_norm and c.attention_bias
        assert c.rope_dim == 8   # partial_rotary_factor 0.5 of head_dim 16
        assert isinstance(tiny.model.new_kv_cache(4, 4), PagedKVCache)
    else:
        assert c.attention == "mla" and c.q_lora_rank == h.q_lora_rank
        kv = tiny.model.new_kv_cache(4, 4)
        assert isinstance(kv, LatentKVCache)
        # the cache holds only the latent + rotary key (+ the indexer key with DSA) per token
        assert kv.latent.shape == (3, 16, 32) and kv.rope.shape == (3, 16, 8)
        assert (kv.index_k is not None) == c.dsa
        assert tiny.model.kv_bytes_per_token() == 3 * 4 * (32 + 8 + (16 if c.dsa else 0))
    if c.dsa:
        assert c.index_topk == 6 and c.index_rope_interleave == (tiny.name == "glm5")
        assert c.indexer_types == (["full", "shared", "full"] if tiny.name == "glm5" else ["full"] * 3)


def test_rope_matches_hf(tiny: Tiny):
    """Inverse frequencies and the cos/sin amplitude (YaRN included) equal transformers'."""
    rot = tiny.hf.model.rotary_emb
    assert torch.allclose(tiny.model.inv_freq, rot.inv_freq.float(), rtol=1e-6, atol=0)
    assert tiny.model.rope_amp == pytest.approx(rot.attention_scaling, rel=1e-6)
    if tiny.name == "v3_noqlora_yarn":
        assert tiny.model.rope_amp != 1.0
        assert tiny.model.scale == pytest.approx(tiny.hf.model.layers[0].self_attn.scaling, rel=1e-6)
        assert tiny.model.scale != (16 + 8) ** -0.5


def test_router_matches_hf(tiny: Tiny):
    """Expert choice (grouped top-k with the correction bias) and weights equal transformers' router."""
    h = torch.randn(40, 64, generator=torch.Generator().manual_seed(5))
    ids, w = tiny.model.route(tiny.model.layers[1].ffn, h)
    with torch.no_grad():
        _, ref_w, ref_ids = tiny.hf.model.layers[1].mlp.gate(h)
    for row in range(h.shape[0]):   # same experts, same weights (order aside)
        o, r = ids[row].argsort(), ref_ids[row].argsort()
        assert ids[row][o].tolist() == ref_ids[row][r].tolist()
        assert torch.allclose(w[row][o], ref_w[row][r], atol=1e-6)


# -- logits -------------------------------------------------------------------------------------

def test_prefill_all_positions(tiny: Tiny):
    toks = prompt(23, seed=1)
    kv = tiny.model.new_kv_cache(num_blocks=8, block_size=4)
    ours = run_step(tiny.model, kv, [(SequenceKV(kv), 0, toks)], all_rows=True)
    ref = hf_logits(tiny.hf, toks)
    assert ours.shape == ref.shape == (23, VOCAB)
    assert_close(ours, ref)


@pytest.mark.parametrize("gather", [False, True], ids=["contiguous", "gathered"])
def test_chunked_prefill_then_decode(tiny: Tiny, gather: bool):
    toks = prompt(20, seed=2)
    n_prompt, split = 13, 6
    ref = hf_logits(tiny.hf, toks)
    kv = tiny.model.new_kv_cache(num_blocks=16, block_size=4)
    seq, other = SequenceKV(kv), SequenceKV(kv)
    if gather:  # interleave another sequence's blocks so ours are not consecutive
        seq.reserve(4)
        other.reserve(4)
        seq.reserve(12)
        other.reserve(8)
        assert seq.contiguous_range(n_prompt) is None
    out1 = run_step(tiny.model, kv, [(seq, 0, toks[:split])], gather=gather)
    assert_close(out1[0], ref[split - 1])
    out2 = run_step(tiny.model, kv, [(seq, split, toks[split:n_prompt])], gather=gather, all_rows=True)
    assert_close(out2, ref[split:n_prompt])
    for p in range(n_prompt, len(toks)):  # decode (absorbed MLA), one token at a time
        out = run_step(tiny.model, kv, [(seq, p, [toks[p]])], gather=gather)
        assert_close(out[0], ref[p])
    seq.release()
    other.release()
    assert kv.allocator.num_free == kv.num_blocks


def test_absorbed_equals_naive(tiny: Tiny):
    """MLA's two forms (latent-space attention with kv_b folded in, and expanded keys/values) agree
    on a whole prefill (every row, so every context length) and on decode steps."""
    if not is_mla(tiny):
        pytest.skip("GQA attention has no absorbed form")
    toks = prompt(18, seed=3)
    outs = {}
    for mode in ("naive", "absorbed"):
        tiny.model.mla_mode = mode
        try:
            kv = tiny.model.new_kv_cache(num_blocks=8, block_size=4)
            seq = SequenceKV(kv)
            rows = [run_step(tiny.model, kv, [(seq, 0, toks[:15])], all_rows=True)]
            rows += [run_step(tiny.model, kv, [(seq, p, [toks[p]])]) for p in range(15, 18)]
            outs[mode] = torch.cat(rows)
        finally:
            tiny.model.mla_mode = "auto"
    assert_close(outs["absorbed"], outs["naive"], atol=1e-5)


def test_batched_step_equals_alone(tiny: Tiny):
    """Two sequences in one step (prefill, then decode) equal each run alone."""
    a, b = prompt(12, seed=4), prompt(9, seed=5)
    na, nb = prompt(3, seed=6), prompt(3, seed=7)
    m = tiny.model
    alone = {}
    for key, toks, nxt in (("a", a, na), ("b", b, nb)):
        kv = m.new_kv_cache(num_blocks=16, block_size=4)
        seq = SequenceKV(kv)
        outs = [run_step(m, kv, [(seq, 0, toks)], all_rows=True)]
        outs += [run_step(m, kv, [(seq, len(toks) + i, [t])]) for i, t in enumerate(nxt)]
        alone[key] = outs
    kv = m.new_kv_cache(num_blocks=16, block_size=4)
    sa, sb = SequenceKV(kv), SequenceKV(kv)
    out = run_step(m, kv, [(sa, 0, a), (sb, 0, b)], all_rows=True)
    assert_close(out[:len(a)], alone["a"][0], atol=1e-5)
    assert_close(out[len(a):], alone["b"][0], atol=1e-5)
    for i in range(3):
        out = run_step(m, kv, [(sa, len(a) + i, [na[i]]), (sb, len(b) + i, [nb[i]])])
        assert_close(out[0], alone["a"][i + 1][0], atol=1e-5)
        assert_close(out[1], alone["b"][i + 1][0], atol=1e-5)


# -- greedy through the engine ------------------------------------------------------------------

def test_greedy_32_tokens_through_engine(tiny: Tiny):
    """`LLM.generate` (scheduler, paged cache, batch of two prompts) = transformers' greedy generate."""
    prompts = [prompt(9, seed=8), prompt(5, seed=9)]
    expected = []
    for p in prompts:
        with torch.no_grad():
            gen = tiny.hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
        expected.append(gen[0, len(p):].tolist())
    llm = LLM(str(tiny.folder), max_model_len=128, kv_cache_tokens=256)
    assert isinstance(llm.model, DeepseekModel)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert all(len(e) == 32 for e in expected)


def test_greedy_with_ngram_speculation(tiny: Tiny):
    """The engine's speculative decoding verifies several rows per sequence in one step (prefill-like
    rows after cached tokens, absorbed MLA not used) and rolls rejected KV back: still lossless."""
    p = prompt(6, seed=10) * 3   # repeats, so the n-gram proposer has something to propose
    with torch.no_grad():
        gen = tiny.hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    llm = LLM(str(tiny.folder), max_model_len=128, kv_cache_tokens=256, speculative="ngram",
              num_speculative_tokens=3)
    out = llm.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert out[0].token_ids == gen[0, len(p):].tolist()


# -- DeepSeek Sparse Attention ------------------------------------------------------------------

def test_dsa_sparsity_changes_the_result(tiny: Tiny):
    """With index_topk (6) below the context (23) the selection matters: the same weights with
    dense attention give other logits, and only the sparse ones match transformers (every
    position, so both the all-selected early rows and the restricted later rows are checked)."""
    if not tiny.cfg.dsa:
        pytest.skip("dense attention")
    if tiny.name == "glm5":   # layer 1 reuses layer 0's selection
        assert tiny.hf.model.layers[1].self_attn.indexer is None
        assert tiny.model.layers[1].attn.indexer is None and tiny.model.layers[2].attn.indexer is not None
    toks = prompt(23, seed=11)
    ref = hf_logits(tiny.hf, toks)
    kv = tiny.model.new_kv_cache(num_blocks=8, block_size=4)
    sparse = run_step(tiny.model, kv, [(SequenceKV(kv), 0, toks)], all_rows=True)
    tiny.cfg.index_topk = 10 ** 6
    try:
        kv = tiny.model.new_kv_cache(num_blocks=8, block_size=4)
        dense = run_step(tiny.model, kv, [(SequenceKV(kv), 0, toks)], all_rows=True)
    finally:
        tiny.cfg.index_topk = 6
    assert_close(sparse, ref)
    assert_close(dense[:6], ref[:6])          # up to 6 tokens of context nothing is dropped
    assert (dense[6:] - ref[6:]).abs().max().item() > 1e-2


def test_dsa_indexer_rope_layout(tiny: Tiny):
    """GLM-5's indexer rotates interleaved pairs, DeepSeek-V3.2's halves: the other layout gives
    other selections (and logits away from transformers')."""
    if not tiny.cfg.dsa:
        pytest.skip("dense attention")
    toks = prompt(23, seed=12)
    ref = hf_logits(tiny.hf, toks)
    tiny.cfg.index_rope_interleave = not tiny.cfg.index_rope_interleave
    try:
        kv = tiny.model.new_kv_cache(num_blocks=8, block_size=4)
        wrong = run_step(tiny.model, kv, [(SequenceKV(kv), 0, toks)], all_rows=True)
    finally:
        tiny.cfg.index_rope_interleave = not tiny.cfg.index_rope_interleave
    assert (wrong - ref).abs().max().item() > 1e-3


# -- FP8 checkpoints ----------------------------------------------------------------------------

def _quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8: e4m3 codes and per-block factors (weight ~= code * scale_inv)."""
    n, k = w.shape
    scale = torch.empty(-(-n // block), -(-k // block))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def test_dequantize_fp8_blocks():
    from slipstream.weights.safetensors import dequantize_fp8
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, s = _quantize_fp8(w, 128)
    assert s.shape == (3, 2)
    out = dequantize_fp8({"a.weight": q, "a.weight_scale_inv": s, "n.weight": w[0]})
    assert set(out) == {"a.weight", "n.weight"}
    expected = q.float().clone()
    for i in range(300):
        for j in range(0, 200, 8):
            expected[i, j:j + 8] *= s[i // 128, j // 128]
    assert torch.equal(out["a.weight"], expected)
    assert (out["a.weight"] - w).abs().max() < 0.1 * w.abs().max()


def test_fp8_checkpoint_matches_dequantized(tmp_path: Path):
    """An FP8 checkpoint (linear weights as e4m3 + weight_scale_inv, blocks of 32 here so that
    tensors span several blocks and partial edge blocks) loads to the dequantized weights: logits
    equal transformers' on a float32 copy of those very weights."""
    from safetensors.torch import load_file, save_file
    model_type, extra = VARIANTS["v3"]
    hf = hf_model(model_type, extra, seed=21)
    src = tmp_path / "src"
    hf.save_pretrained(src, safe_serialization=True)
    state = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in state.items():
        if t.dim() == 2 and "_proj." in name:
            q, s = _quantize_fp8(t, 32)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = q.float() * s.repeat_interleave(32, 0).repeat_interleave(32, 1)[:t.shape[0], :t.shape[1]]
        else:
            fp8[name] = deq[name] = t
    assert any(v.dtype == torch.float8_e4m3fn for v in fp8.values())
    conf = json.loads((src / "config.json").read_text())
    for sub, tensors, cfg_extra in (("fp8", fp8, {"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [32, 32]}}), ("ref", deq, {})):
        (tmp_path / sub).mkdir()
        save_file(tensors, str(tmp_path / sub / "model.safetensors"))
        (tmp_path / sub / "config.json").write_text(json.dumps({**conf, **cfg_extra}))
    ref_hf = getattr(transformers, "DeepseekV3ForCausalLM").from_pretrained(
        tmp_path / "ref", torch_dtype=torch.float32).eval()
    cfg, weights = load_hf(tmp_path / "fp8")
    model = build_model(cfg, weights)
    toks = prompt(15, seed=13)
    kv = model.new_kv_cache(num_blocks=8, block_size=4)
    ours = run_step(model, kv, [(SequenceKV(kv), 0, toks)], all_rows=True)
    assert_close(ours, hf_logits(ref_hf, toks))
    assert torch.equal(weights["layers.1"].attn.kv_b(), deq["model.layers.1.self_attn.kv_b_proj.weight"])


# -- MTP ----------------------------------------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def save_with_mtp_layer(hf, folder: Path, seed: int = 32):
    """Save `hf` with one extra random MTP layer (model.layers.{N}.*) and num_nextn_predict_layers 1;
    returns (the decoder block, the MTP-only weights) for reference computations."""
    from safetensors.torch import save_file

    hf.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    c = hf.config
    N = c.num_hidden_layers
    D = c.hidden_size
    block = type(hf.model.layers[1])(c, layer_idx=1).eval()
    _randomize(block, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    extra_w = {"enorm.weight": 1 + 0.2 * torch.randn(D, generator=g),
               "hnorm.weight": 1 + 0.2 * torch.randn(D, generator=g),
               "eh_proj.weight": torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5,
               "shared_head.norm.weight": 1 + 0.2 * torch.randn(D, generator=g),
               "shared_head.head.weight": torch.randn(VOCAB, D, generator=g) / D ** 0.5}
    tensors = {}
    I = c.moe_intermediate_size
    for k, v in block.state_dict().items():
        if k == "mlp.experts.gate_up_proj":     # per-expert checkpoint names
            for e in range(v.shape[0]):
                tensors[f"mlp.experts.{e}.gate_proj.weight"] = v[e, :I]
                tensors[f"mlp.experts.{e}.up_proj.weight"] = v[e, I:]
        elif k == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                tensors[f"mlp.experts.{e}.down_proj.weight"] = v[e]
        else:
            tensors[k] = v
    tensors.update(extra_w)
    save_file({f"model.layers.{N}.{k}": v.contiguous() for k, v in tensors.items()},
              str(folder / "mtp.safetensors"))
    conf = json.loads((folder / "config.json").read_text())
    conf["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(conf))
    return block, extra_w


@pytest.mark.parametrize("name", ["v3", "glm4_moe"])
def test_mtp_layer_matches_its_equations(name: str, tmp_path: Path):
    """A checkpoint with one MTP layer (model.layers.3.*: enorm, hnorm, eh_proj, a MoE decoder
    layer, shared_head). Reference, with transformers' own decoder-layer class for the block:
        h_i   = final-normed hidden state of the main model at position i
        x_i   = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])
        x     = DecoderLayer(x) over positions 0..n-1 (causal)
        logit = shared_head.head(shared_head.norm(x_i))
    checked on a prefill of all rows, then one decode step through the MTP layer's own KV."""
    model_type, extra = VARIANTS[name]
    hf = hf_model(model_type, extra, seed=31)
    folder = tmp_path / name
    block, extra_w = save_with_mtp_layer(hf, folder)
    cfg, weights = load_hf(folder)
    model = build_model(cfg, weights)
    assert len(model.mtp) == 1 and model.num_cache_layers == 4

    toks = prompt(12, seed=14)
    n = len(toks) - 1
    with torch.no_grad():
        h_ref = hf.model(torch.tensor([toks])).last_hidden_state[0]
        e = hf.model.embed_tokens(torch.tensor(toks[1:]))
        x = F.linear(torch.cat([_rms(e, extra_w["enorm.weight"]),
                                _rms(h_ref[:n], extra_w["hnorm.weight"])], -1), extra_w["eh_proj.weight"])
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = block(x[None], attention_mask=mask, position_ids=pos,
                  position_embeddings=hf.model.rotary_emb(x[None], pos))[0]
        ref = F.linear(_rms(x, extra_w["shared_head.norm.weight"]), extra_w["shared_head.head.weight"])

    kv = model.new_kv_cache(num_blocks=8, block_size=4)
    seq = SequenceKV(kv)
    logits, h = run_step(model, kv, [(seq, 0, toks)], all_rows=True, return_hidden=True)
    assert_close(h, h_ref, atol=1e-5)

    def mtp_step(start: int, next_tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        step = prefill_step(seq, next_tokens, start, logits="all", gather=True)
        out, _ = model.mtp_forward(step, kv, hidden)
        return out

    # MTP prefill over positions 0..n-2, then position n-1 as a decode step against its KV
    assert_close(mtp_step(0, toks[1:n], h[:n - 1]), ref[:n - 1])
    assert_close(mtp_step(n - 1, toks[n:n + 1], h[n - 1:n]), ref[n - 1:n])


# -- config.json forms --------------------------------------------------------------------------

def test_rope_scaling_v4_and_v5_forms_agree():
    """DeepSeek-V3's config.json as published (v4 `rope_scaling` with "type", `rope_theta` beside it)
    and transformers v5's `rope_parameters` give the same frequencies and scales."""
    from slipstream.models.deepseek import rope_parameters
    base = dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=64,
                qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=163840)
    yarn = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}
    v4 = DeepseekConfig.from_hf({**base, "rope_theta": 10000, "rope_scaling": {**yarn, "type": "yarn"}})
    v5 = DeepseekConfig.from_hf({**base, "rope_parameters": {**yarn, "rope_type": "yarn",
                                                              "rope_theta": 10000.0}})
    (f4, a4, m4), (f5, a5, m5) = rope_parameters(v4), rope_parameters(v5)
    assert torch.equal(f4, f5) and a4 == a5 == 1.0 and m4 == m5
    assert m4 == pytest.approx((0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    assert v4.num_nextn_predict_layers == 0 and v4.q_lora_rank is None


def test_unsupported_model_type_lists_family(tmp_path: Path):
    from slipstream.errors import ModelLoadError
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v2"}))
    with pytest.raises(ModelLoadError, match="deepseek_v3"):
        load_hf(tmp_path)


@pytest.mark.parametrize("name", ["v3", "glm4_moe"])
def test_mtp_speculation_through_the_engine_is_lossless(name: str, tmp_path: Path):
    """`--speculative mtp`: the model's own MTP layer drafts, the target verifies; greedy output is
    the plain greedy output, and a draft is made at nearly every step (the MTP state follows the
    target through prefill, verification and rollback)."""
    model_type, extra = VARIANTS[name]
    hf = hf_model(model_type, extra, seed=41)
    folder = tmp_path / name
    save_with_mtp_layer(hf, folder, seed=42)
    prompts = [prompt(10, seed=1), prompt(17, seed=2)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = LLM(str(folder), max_model_len=128, kv_cache_tokens=256).generate(prompts, params)
    spec = LLM(str(folder), max_model_len=128, kv_cache_tokens=256, speculative="mtp", num_speculative_tokens=2)
    out = spec.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    s = spec.engine.stats()
    steps = s.spec_verifications
    assert steps > 0 and s.spec_emitted_tokens >= steps
    # every verification step of every sequence carried guesses: 2 x 31 tokens over <= 31 steps each
    assert steps >= 2 * 31 / 3
    assert s.kv_blocks_in_use == 0 and not spec.engine.proposer.state
    sampled = spec.generate(prompts, SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True))
    assert [len(o.token_ids) for o in sampled] == [12, 12]
    # another tiny MoE model of the family, same vocabulary, as a draft model: lossless too
    other = tmp_path / "draft"
    hf_model(*VARIANTS["v3_noqlora_yarn"], seed=43).save_pretrained(other, safe_serialization=True)
    write_tokenizer(other)
    drafted = LLM(str(folder), max_model_len=128, kv_cache_tokens=256, speculative=f"draft:{other}",
                  num_speculative_tokens=3)
    assert [o.token_ids for o in drafted.generate(prompts, params)] == [o.token_ids for o in plain]
    assert drafted.engine.stats().spec_verifications > 0


def test_mtp_speculation_needs_mtp_layers(tiny):
    with pytest.raises(SlipstreamError, match="MTP layers"):
        LLM(str(tiny.folder), max_model_len=128, kv_cache_tokens=256, speculative="mtp")
