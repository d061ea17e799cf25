"""An fp16 KV cache (EngineConfig.kv_cache_dtype, `--kv-cache-dtype`): the native step stores K and V
rounded to half precision and widens them in registers; the eager step upcasts them for its maths.

What must hold: the native exact path over an fp16 cache matches the eager step over the same cache
(float32 noise) and stays within the cache's rounding of the fp32 one; the fast path over an fp16
cache is as close to the eager fp32 reference as over an fp32 cache, and where fp16 and fp32 pick
different greedy tokens it is a near-tie of the reference; "auto" picks fp16 for the native fast path
only; fp16 halves the bytes per token (the cache budget holds twice the tokens, up to the engine's
cap of twice the context); prefix-cache reuse and long (eager) prefills work over it."""
from __future__ import annotations

import pytest
import torch
from support import CACHE_PROMPTS, assert_flips_only_at_near_ties, decode_step, prefill_step, teacher_forced

from slipstream.engine.config import EngineConfig, EngineConfigError
from slipstream.errors import SlipstreamError
from slipstream.kernels.cpu import load_library
from slipstream.kv.blocks import SequenceKV
from slipstream.models.llama import LlamaModel
from slipstream.runtime.cpu_team import CpuTeamDecoder
from slipstream.runtime.registry import kv_cache_dtype

pytestmark = pytest.mark.skipif(load_library() is None, reason="native CPU kernels unavailable")

def _teacher_forced(model: LlamaModel, steps: int) -> dict[str, list[torch.Tensor]]:
    """Logits per step of the eager step (fp32 cache) and of the native step with (fast|exact, fp32|fp16)
    caches, all fed the eager step's greedy tokens."""
    runs = {"eager": (None, torch.float32), "fast32": (False, torch.float32), "fast16": (False, torch.float16),
            "exact16": (True, torch.float16)}
    return teacher_forced(model, CACHE_PROMPTS, runs, steps)


def test_fp16_cache_on_the_native_step(smollm2):
    out = _teacher_forced(smollm2, 8)
    ref = out["eager"]
    rel = {n: sorted(((lt - le).norm() / le.norm()).item() for le, lt in zip(ref, out[n]))
           for n in ("fast32", "fast16", "exact16")}
    # the exact path over fp16 K/V: the fp32 result up to the cache's rounding (measured ~4e-4 relative)
    assert rel["exact16"][-1] < 2e-3, rel["exact16"]
    for le, lt in zip(ref, out["exact16"]):
        assert le.argmax(-1).tolist() == lt.argmax(-1).tolist()
    # the fast path: as close to the reference with an fp16 cache as with an fp32 one (int8 activations
    # dominate: both ~2.4% median on this model)
    median = {n: r[len(r) // 2] for n, r in rel.items()}
    assert median["fast16"] < 1.2 * median["fast32"] + 2e-3, median
    assert rel["fast16"][-1] < 0.08, rel["fast16"]
    # greedy picks: fp16 and fp32 caches agree except at near-ties of the reference (the fast path is
    # discontinuous in its inputs: a 1e-4 change in K can move an int8 rounding of a later activation;
    # measured flips over 48 steps x 4 prompts had reference top-2 gaps of 0.006 to 0.72, logits ~20)
    assert_flips_only_at_near_ties(ref, out["fast32"], out["fast16"], "fp16 and fp32 caches")


def test_native_and_eager_read_the_same_fp16_cache(smollm2):
    """Rows the native step stores, read back by the eager step (and the other way round): both write
    the same half-precision values (round to nearest even), so eager over a cache the team filled
    gives the team's greedy tokens (exact path)."""
    kv = smollm2.new_kv_cache(32, dtype=torch.float16)
    team = CpuTeamDecoder(smollm2, kv, exact=True)
    seq = SequenceKV(kv)
    prompt = CACHE_PROMPTS[3]
    team.forward(prefill_step(seq, prompt, extra=4))          # the team writes the prompt's rows
    k_team = kv.k[:, :len(prompt)].clone()
    kv2 = smollm2.new_kv_cache(32, dtype=torch.float16)
    seq2 = SequenceKV(kv2)
    smollm2.forward(prefill_step(seq2, prompt, extra=4), kv2)  # eager writes them
    k_eager = kv2.k[:, :len(prompt)]
    # same values up to one half-precision step where the fp32 inputs differed in summation order
    torch.testing.assert_close(k_team.float(), k_eager.float(), rtol=2e-3, atol=2e-3)
    step = decode_step([seq], [77], [len(prompt)])
    lt = team.forward(step)
    le = smollm2.forward(decode_step([seq], [77], [len(prompt)]), kv)
    assert (lt - le).abs().max().item() < 5e-3
    assert lt.argmax(-1).tolist() == le.argmax(-1).tolist()


def test_auto_picks_fp16_for_the_native_fast_path_only(smollm2):
    assert kv_cache_dtype("auto", "native", smollm2, exact=False) == torch.float16
    assert kv_cache_dtype("auto", "native", smollm2, exact=True) == torch.float32
    assert kv_cache_dtype("auto", "eager", smollm2) in (torch.float32, None)
    assert kv_cache_dtype("fp16", "eager", smollm2) == torch.float16
    assert kv_cache_dtype("fp32", "native", smollm2) == torch.float32
    with pytest.raises(EngineConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_bytes_per_token_halve(smollm2):
    assert smollm2.kv_bytes_per_token(torch.float16) * 2 == smollm2.kv_bytes_per_token(torch.float32)
    assert smollm2.new_kv_cache(4, dtype=torch.float16).k.dtype == torch.float16


def test_engine_sizes_and_uses_an_fp16_cache(smollm2, monkeypatch):
    """Through LLM: auto gives an fp16 cache to the native fast path and fp32 to exact and eager; with the
    budget binding, fp16 fits twice the tokens (up to twice the context); a repeated long prompt (prefilled
    eagerly, past the native step's 64 tokens) reuses its cached prefix and decodes the same tokens."""
    import slipstream.engine.engine as engine_mod
    from slipstream import LLM, SamplingParams

    monkeypatch.setattr(engine_mod, "KV_BUDGET_BYTES", 1300 * smollm2.kv_bytes_per_token(torch.float32))
    sizes = {}
    for kw in ({"kv_cache_dtype": "fp32"}, {}, {"exact": True}, {"runtime": "eager"}):
        llm = LLM(max_model_len=1024, **kw)
        sizes[tuple(kw.items())] = (llm.engine.kv.k.dtype, llm.engine.kv.capacity_tokens)
    assert sizes[(("kv_cache_dtype", "fp32"),)] == (torch.float32, 1312)          # 1300 in blocks of 16
    assert sizes[()] == (torch.float16, 2048)                                     # 2600, capped at 2 x 1024
    assert sizes[(("exact", True),)] == (torch.float32, 1312)
    assert sizes[(("runtime", "eager"),)] == (torch.float32, 1312)

    llm = LLM(max_model_len=1024)
    assert llm.engine.runtime_name == "native" and llm.engine.kv.k.dtype == torch.float16
    prompt = "The history of the city is long and " * 12                        # > 64 tokens: eager prefill
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = llm.generate(prompt, params)[0].token_ids
    hits = llm.engine.stats().prefix_cache_hit_tokens
    second = llm.generate(prompt, params)[0].token_ids
    assert llm.engine.stats().prefix_cache_hit_tokens > hits
    assert first == second


def test_explicit_dtype_refused_on_a_gpu_runtime(smollm2):
    with pytest.raises(SlipstreamError, match="kv-cache-dtype"):
        kv_cache_dtype("fp16", "graph", smollm2)
