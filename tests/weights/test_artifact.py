"""`slipstream compile`: an artifact written once and loaded directly gives the same tokenizer, the
same weights and the same greedy tokens as the model it came from, and loads much faster."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from support import skip_unless_default_model

from slipstream import LLM, SamplingParams
from slipstream.errors import ModelLoadError
from slipstream.weights import load_model


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    skip_unless_default_model()
    out = tmp_path_factory.mktemp("art") / "smollm2"
    p = subprocess.run([sys.executable, "-m", "slipstream", "compile", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "compiled smollm2-135m" in p.stderr
    return out


def test_the_artifact_is_the_same_model(artifact):
    a, b = load_model(artifact), load_model(None)
    assert a.config == b.config
    for text in ["The capital of France is", "  two spaces, digits 12345", "日本の首都は 😀", "<|im_start|>user"]:
        assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.tokenizer.eos_token_ids == b.tokenizer.eos_token_ids
    msgs = [{"role": "user", "content": "Hi"}]
    assert a.tokenizer.apply_chat_template(msgs, add_generation_prompt=True) == \
        b.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    la, lb = LLM(artifact), LLM()
    assert la.engine.runtime_name == lb.engine.runtime_name == "native"
    for L1, L2 in zip(la.model.layers, lb.model.layers):
        for w1, w2 in zip(L1.linears(), L2.linears()):
            assert torch.equal(w1.data, w2.data) and torch.equal(w1.scale, w2.scale)
    p = SamplingParams(max_tokens=24, temperature=0)
    prompts = ["Once upon a time", "def fib(n):"]
    assert [o.token_ids for o in la.generate(prompts, p)] == [o.token_ids for o in lb.generate(prompts, p)]
    manifest = json.loads((artifact / "slipstream-artifact.json").read_text())
    assert manifest["format"] == 4 and manifest["weights"]["lm_head"] == "embed"   # tied weights stored once


def test_the_artifact_carries_validated_plans_and_kernel_configs(artifact):
    from slipstream.runtime.megakernel import MegakernelDecoder
    from slipstream.runtime.plan import Plan, default_tiles, validate

    manifest = json.loads((artifact / "slipstream-artifact.json").read_text())
    k = manifest["kernels"]
    assert k["plan_context"] == 8192
    assert sorted(k["plans"]) == sorted(f"{b},{c}" for b in (1, 2, 4, 8) for c in (512, 2048, 8192))
    # the plans carry the tiles the runtime would choose for the GPU's programs (132 SMs without a GPU)
    programs = k["plan_programs"]
    if not torch.cuda.is_available():
        assert programs == 132
    loaded = load_model(artifact)
    hints = loaded.runtime_hints
    assert hints["kernel_configs"].attention["partition"] == 256
    plan = Plan.load(hints["plans"][(4, 2048)])
    validate(plan)
    assert plan.tiles == default_tiles(loaded.config, 2048, programs)
    assert plan.batch == 4 and plan.num_layers == 30 and plan.max_context == 2048
    assert plan.splits == 2048 // plan.tiles.partition
    if programs == 132:   # SmolLM2-135M: 16-row O/DOWN tiles (36 tasks) and 32-token partitions (3 x 64 tasks)
        assert (plan.tiles.o, plan.tiles.down, plan.tiles.partition, plan.splits) == (16, 16, 32, 64)
    # the megakernel runtime takes the compiled plans instead of compiling them at start-up
    llm = LLM(artifact, kv_cache_tokens=4096, runtime="eager")
    dec = MegakernelDecoder(llm.model, llm.engine.kv, max_batch=4, max_context=4096, plans=hints["plans"])
    assert dec.context_buckets == [512, 2048, 4096]
    assert dec.static(3, 1500).plan == plan                        # (4, 2048): the artifact's plan
    assert dec.static(1, 100).plan == Plan.load(hints["plans"][(1, 512)])
    assert dec.static(1, 3000).plan.max_context == 4096            # no such plan: compiled at start-up


def test_it_loads_faster_than_the_gguf(artifact):
    t = time.perf_counter()
    load_model(artifact)
    art = time.perf_counter() - t
    t = time.perf_counter()
    load_model(None)
    gguf = time.perf_counter() - t
    assert art < gguf / 3, (art, gguf)


def test_generate_runs_from_the_artifact(artifact):
    p = subprocess.run([sys.executable, "-m", "slipstream", "generate", str(artifact), "-p", "Hello", "--max-tokens",
                        "4", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["token_ids"]) == 4


def test_broken_artifacts_are_clear_errors(artifact, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "slipstream-artifact.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ModelLoadError, match="format 99"):
        load_model(bad)
    (bad / "slipstream-artifact.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="unreadable"):
        load_model(bad)
    (bad / "slipstream-artifact.json").write_text((artifact / "slipstream-artifact.json").read_text())
    with pytest.raises(ModelLoadError, match="weights.safetensors is missing"):
        load_model(bad)
    for f in ("weights.safetensors", "tokenizer.json"):   # a manifest naming tensors the file does not hold
        (bad / f).write_bytes((artifact / f).read_bytes())
    manifest = json.loads((artifact / "slipstream-artifact.json").read_text())
    manifest["weights"]["layers"][0]["o"]["parts"] = [{"n": 1, "k": 576, "fmt": 2, "data": True}]
    (bad / "slipstream-artifact.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match="does not match weights.safetensors"):
        load_model(bad)


def _mixed_kquant_gguf(path) -> None:
    """A tiny Llama as a Q4_K_M file is stored: Q4_K query/key/output/FFN rows, Q6_K value rows (so the fused
    QKV matrix is kept in parts), hand-made valid blocks, the 96-token test tokenizer."""
    import gguf
    import numpy as np
    from support import gguf_tokenizer, random_blocks
    hidden, ffn, heads, kv_heads, hd, layers, vocab = 256, 512, 4, 2, 64, 2, 96
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, layers), (w.add_context_length, 256), (w.add_embedding_length, hidden),
                   (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, vocab), (w.add_rope_dimension_count, hd)):
        add(v)
    gguf_tokenizer(w)
    rng = np.random.default_rng(1)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden), dtype=np.float32) * 0.5)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    seed = iter(range(100))

    def q(name: str, qt: int, n: int, k: int) -> None:
        w.add_tensor(name, random_blocks(qt, n, k, seed=next(seed), size=k ** -0.5),
                     raw_dtype=gguf.GGMLQuantizationType(qt))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        q(f"blk.{i}.attn_q.weight", 12, heads * hd, hidden)
        q(f"blk.{i}.attn_k.weight", 12, kv_heads * hd, hidden)
        q(f"blk.{i}.attn_v.weight", 14, kv_heads * hd, hidden)
        q(f"blk.{i}.attn_output.weight", 12, hidden, heads * hd)
        q(f"blk.{i}.ffn_gate.weight", 12, ffn, hidden)
        q(f"blk.{i}.ffn_up.weight", 12, ffn, hidden)
        q(f"blk.{i}.ffn_down.weight", 14, hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_matrix_stored_in_parts_survives_the_artifact(tmp_path):
    """A Q4_K_M-style file's fused QKV (Q4_K rows beside Q6_K rows) is kept in parts: the artifact stores
    each part (it stored none, and loading it failed), and decodes the same greedy tokens as the GGUF."""
    from slipstream.compiler import compile_model
    src, out = tmp_path / "m.gguf", tmp_path / "art"
    _mixed_kquant_gguf(src)
    compile_model(src, out)
    a, b = LLM(src), LLM(out)
    assert b.model.layers[0].qkv.parts and len(b.model.layers[0].qkv.parts) == len(a.model.layers[0].qkv.parts)
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in b.generate([[5, 9, 13, 40]], p)] == [o.token_ids for o in a.generate([[5, 9, 13, 40]], p)]


def test_format_1_artifacts_still_load(artifact, tmp_path):
    """Format 2 marks artifacts whose Q4_K matrices may hold only their 6-bit scales (an older Slipstream asks
    to compile again instead of failing in the runtime); format 1 ones (written before) load as they are."""
    old = tmp_path / "old"
    old.mkdir()
    for f in artifact.iterdir():
        (old / f.name).symlink_to(f)
    manifest = json.loads((artifact / "slipstream-artifact.json").read_text())
    (old / "slipstream-artifact.json").unlink()
    (old / "slipstream-artifact.json").write_text(json.dumps({**manifest, "format": 1}))
    assert load_model(old) is not None
