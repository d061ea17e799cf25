"""The new families through the whole engine (`LLM.generate`, continuous batching, the runtime the
registry picks) from a GGUF with a tokenizer: greedy tokens equal transformers' generate() on the
same (dequantized) weights, two prompts batched in one call."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from support import gguf_tokenizer, hf_greedy

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

HERE = Path(__file__).parent


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_engine_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _family(family: str, path: Path) -> torch.nn.Module:
    """transformers' model for `family`, with the weights of the GGUF written to `path`."""
    Q = gguf.GGMLQuantizationType
    if family == "gemma2":
        m = _module("test_gemma2")
        hf = m.hf_gemma2(seed=11)
        m.write_gguf(hf, path, {"token_embd": Q.Q8_0, "ffn_down": Q.Q5_1}, gguf_tokenizer)
    elif family == "phi3":
        m = _module("test_phi3")
        hf = m.hf_phi3(0.75, True, seed=11)
        m.write_gguf(hf, path, {"attn_qkv": Q.Q8_0}, gguf_tokenizer)
    else:
        m = _module("test_qwen_moe")
        hf = m.hf_moe(family, seed=11)
        m.write_gguf(hf, path, family, {"ffn_gate_exps": Q.Q4_0, "ffn_down_exps": Q.Q8_0}, gguf_tokenizer)
    return hf


@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen2moe", "qwen3moe"])
def test_llm_generate_matches_transformers(tmp_path: Path, family: str):
    from slipstream import LLM, SamplingParams
    path = tmp_path / f"{family}.gguf"
    hf = _family(family, path)
    llm = LLM(str(path), max_model_len=64, exact=True)   # exact: the native step's fp32 activations
    assert llm.engine.runtime_name == "native"
    n = 7   # Phi-3: prompt and answer stay within its 16 short-factor positions
    outs = llm.generate(["abc!def", "xyz"], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for o in outs:
        # hf_greedy's explicit mask: generate() would otherwise mask the prompt's token 0 ("!") as padding
        assert o.token_ids == hf_greedy(hf, o.prompt_token_ids, n), (family, o.prompt_token_ids)
