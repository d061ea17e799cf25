"""A Phi-3-style model whose every layer slides: the engine gives back each sequence's blocks outside
the window while it generates, and the tokens stay those of transformers' generate() (exact path)
and of the same engine keeping every block (both paths, eager and native)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from support import gguf_tokenizer, hf_greedy

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

WINDOW, BLOCK, NEW = 8, 4, 44


def _phi3_module():
    spec = importlib.util.spec_from_file_location("_window_phi3", Path(__file__).parents[1] / "models" / "test_phi3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    m = _phi3_module()
    hf = m.hf_phi3(1.0, False, seed=11, longrope=False, window=WINDOW)
    path = tmp_path_factory.mktemp("window") / "phi3w.gguf"
    m.write_gguf(hf, path, {"attn_qkv": gguf.GGMLQuantizationType.Q8_0}, gguf_tokenizer)
    return hf, path


def _generate(path: Path, runtime: str, exact: bool, drop: bool) -> tuple[list[int], list[int], int]:
    from slipstream import LLM, SamplingParams
    llm = LLM(str(path), max_model_len=64, block_size=BLOCK, runtime=runtime, exact=exact)
    eng = llm.engine
    assert eng.kv.window == WINDOW
    if not drop:
        eng.kv.window = None
    peak = 0
    step = eng.step

    def counted():
        nonlocal peak
        events = step()
        peak = max(peak, eng.kv.allocator.num_in_use)
        return events
    eng.step = counted
    out = llm.generate(["abc"], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))[0]
    assert eng.kv.allocator.num_in_use == (1 if drop else 0)   # only the spare block is still held
    return out.prompt_token_ids, out.token_ids, peak


@pytest.mark.parametrize("runtime,exact", [("native", True), ("native", False), ("eager", True)])
def test_blocks_outside_the_window_go_back_and_tokens_do_not_change(model, runtime, exact):
    hf, path = model
    prompt, tokens, peak = _generate(path, runtime, exact, drop=True)
    _, kept_tokens, kept_peak = _generate(path, runtime, exact, drop=False)
    assert tokens == kept_tokens
    total = len(prompt) + NEW
    assert kept_peak >= total // BLOCK
    # the window's blocks, one of slack, the one being filled, the next one reserved, and the spare
    assert peak <= WINDOW // BLOCK + 4 < kept_peak
    if exact:
        assert tokens == hf_greedy(hf, prompt, NEW)
