"""Gemma 2 (sliding-window layers between global ones) through the engine: the sliding layers give back
each block's local part once no window can see it while the global layers keep every block, and the
tokens stay those of transformers' generate() and of the same engine keeping every part, on the
native step (both paths) and the eager one; a conversation's next turn reuses its prefix."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from support import gguf_tokenizer, hf_greedy

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

BLOCK, NEW = 4, 40


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    gemma2 = Path(__file__).parents[1] / "models" / "test_gemma2.py"
    spec = importlib.util.spec_from_file_location("_hybrid_gemma2", gemma2)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    hf = m.hf_gemma2(seed=11)
    path = tmp_path_factory.mktemp("hybrid") / "gemma2.gguf"
    m.write_gguf(hf, path, {"attn_v": gguf.GGMLQuantizationType.Q8_0}, gguf_tokenizer)
    return hf, path


def _llm(path: Path, runtime: str, exact: bool, **kw):
    from slipstream import LLM
    from slipstream.kv.blocks import HybridKVCache
    llm = LLM(str(path), max_model_len=96, block_size=BLOCK, runtime=runtime, exact=exact, **kw)
    assert isinstance(llm.engine.kv, HybridKVCache) and llm.engine.kv.local_window == 6
    return llm


def _generate(path: Path, runtime: str, exact: bool, drop: bool) -> tuple[list[int], list[int], int, int]:
    from slipstream import SamplingParams
    llm = _llm(path, runtime, exact)
    eng = llm.engine
    kv = eng.kv
    if not drop:
        kv.local_window = 10 ** 6
    kv.k_local[:, :kv.spare_part * BLOCK].fill_(float("nan"))   # unwritten: the sliding layers must not read it
    peak_parts = peak_blocks = 0
    step = eng.step

    def counted():
        nonlocal peak_parts, peak_blocks
        for part in kv._free_parts:     # stale: a part handed out in this step must be written before it is read
            kv.k_local[:, part * BLOCK:(part + 1) * BLOCK] = float("nan")
            kv.v_local[:, part * BLOCK:(part + 1) * BLOCK] = float("nan")
        events = step()
        peak_parts, peak_blocks = max(peak_parts, kv.parts_touched), max(peak_blocks, kv.allocator.num_in_use)
        for r in eng.scheduler.running:   # the newest token's K sits in its block's part
            n = r.kv.num_tokens
            assert not kv.k_local[:, kv.local_slots(r.kv.slots(n - 1, n))].isnan().any()
        return events
    eng.step = counted
    out = llm.generate(["abc"], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))[0]
    assert kv.parts_held == 0 and kv.allocator.num_in_use == 0
    return out.prompt_token_ids, out.token_ids, peak_parts, peak_blocks


@pytest.mark.parametrize("runtime,exact", [("native", True), ("native", False), ("eager", True)])
def test_parts_outside_the_window_go_back_and_tokens_do_not_change(model, runtime, exact):
    hf, path = model
    prompt, tokens, parts, blocks = _generate(path, runtime, exact, drop=True)
    _, kept_tokens, kept_parts, _ = _generate(path, runtime, exact, drop=False)
    assert tokens == kept_tokens
    assert blocks >= (len(prompt) + NEW) // BLOCK and kept_parts >= (len(prompt) + NEW) // BLOCK
    # parts ever written (prefix caching on: the parts behind the window are kept until needed): the
    # window's two blocks, one of slack, the one being filled and the next one reserved
    assert parts <= 6 // BLOCK + 4 < kept_parts
    if exact:
        assert tokens == hf_greedy(hf, prompt, NEW)


def test_the_next_turn_reuses_the_prefix_with_its_last_window(model):
    from slipstream import SamplingParams
    _, path = model
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = _llm(path, "native", True)
    first = llm.generate(["abc!def"], params)[0]
    turn = first.prompt_token_ids + first.token_ids + first.prompt_token_ids
    hits = llm.engine.prefix_cache.hit_tokens
    again = llm.generate([turn], params)[0]
    assert llm.engine.prefix_cache.hit_tokens - hits >= 4 * BLOCK     # most of the first turn was reused
    fresh = _llm(path, "native", True, enable_prefix_cache=False).generate([turn], params)[0]
    assert again.token_ids == fresh.token_ids


@pytest.mark.parametrize("runtime", ["native", "eager"])
def test_an_int8_cache_gives_back_parts_and_keeps_its_tokens(model, runtime):
    """`--kv-cache-dtype int8` on the hybrid cache: codes and scales in the sliding layers' parts too; giving back
    the parts behind the window changes no token (they are never read again) and every part and block comes
    back, on the native fast path and the eager step."""
    from slipstream import SamplingParams
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs = []
    for drop in (True, False):
        llm = _llm(model[1], runtime, False, kv_cache_dtype="int8")
        kv = llm.engine.kv
        assert kv.k_local.dtype == torch.int8 and kv.k_local_scale is not None
        if not drop:
            kv.local_window = 10 ** 6
        outs.append(llm.generate(["abc"], params)[0].token_ids)
        assert kv.parts_held == 0 and kv.allocator.num_in_use == 0
    assert outs[0] == outs[1] and len(outs[0]) == NEW
