"""An int8 KV cache (`--kv-cache-dtype int8`): K and V rows stored as 8-bit codes with one float32 scale per
(token, KV head) row (kv/blocks.py int8_rows), about half of fp16's bytes; the native step quantizes them as
it stores them and scales scores and value weights as attention reads them; the eager step (long prompts,
the eager runtime) writes and reads the same codes through PagedKVCache.store/read.

What must hold: the native step and the eager step store the same codes and scales for the same K and V
rows (up to the rows' own fp32 noise); the native fast path over an int8 cache stays as close to the eager
fp32 reference as over an fp16 one within a stated margin, and its greedy picks differ only at near-ties of
the reference; bytes per token are D + 4 per row; Gemma's hybrid cache keeps scales for its sliding layers'
parts; the exact path and models without a dtype choice refuse it in one clear error; a long (eager) prompt, prefix reuse and decoding work through LLM."""
from __future__ import annotations

import pytest
import torch
from support import CACHE_PROMPTS, assert_flips_only_at_near_ties, prefill_step, teacher_forced

from slipstream.errors import SlipstreamError
from slipstream.kernels.cpu import load_library
from slipstream.kv.blocks import HybridKVCache, PagedKVCache, SequenceKV, int8_rows
from slipstream.runtime.cpu_team import CpuTeamDecoder
from slipstream.runtime.registry import kv_cache_dtype

pytestmark = pytest.mark.skipif(load_library() is None, reason="native CPU kernels unavailable")

def test_int8_rows_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * 4
    codes, scales = int8_rows(x)
    assert codes.dtype == torch.int8 and scales.shape == (50, 3)
    err = (codes.float() * scales[..., None] - x).abs()
    assert (err <= scales[..., None] / 2 * (1 + 1e-5)).all()          # half a step per element at most
    assert (codes.abs().amax(-1) == 127).all()                        # each row's absmax is a full code
    zeros, zs = int8_rows(torch.zeros(2, 64))
    assert not zeros.any() and not zs.any()


def test_paged_cache_stores_and_reads_int8():
    kv = PagedKVCache(2, 4, 16, 3, 64, dtype=torch.int8)
    assert kv.k.dtype == torch.int8 and kv.k_scale is not None and kv.k_scale.shape == (2, 64, 3)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(5, 3, 64, generator=g), torch.randn(5, 3, 64, generator=g)
    slots = torch.tensor([3, 17, 18, 40, 63])
    kv.store(1, slots, k, v)
    rk, rv = kv.read(1, slots)
    torch.testing.assert_close(rk, k, rtol=0, atol=float(k.abs().max()) / 127)
    torch.testing.assert_close(rv, v, rtol=0, atol=float(v.abs().max()) / 127)
    rk2, _ = kv.read(1, (17, 19))                                     # a range reads the same rows
    assert torch.equal(rk2, rk[1:3])
    kv._zero(1)                                                       # block 1 holds slots 16..31
    assert not kv.read(1, (16, 32))[0].any()


def test_bytes_per_token_and_refusals(smollm2):
    c = smollm2.cfg
    assert smollm2.kv_bytes_per_token(torch.int8) == 2 * c.num_layers * c.num_kv_heads * (c.head_dim + 4)
    assert smollm2.kv_bytes_per_token(torch.int8) < 0.6 * smollm2.kv_bytes_per_token(torch.float16)
    assert kv_cache_dtype("int8", "native", smollm2) == torch.int8
    assert kv_cache_dtype("int8", "eager", smollm2) == torch.int8
    with pytest.raises(SlipstreamError, match="exact"):
        kv_cache_dtype("int8", "native", smollm2, exact=True)


def test_hybrid_cache_keeps_scales_for_its_local_parts():
    """Gemma's hybrid cache in int8: the sliding layers' parts have scale planes of their own, the spare part
    reads as zeros, and store/read address each layer's own rows."""
    kv = HybridKVCache([True, False, True], 8, 4, 4, 2, 16, dtype=torch.int8)
    assert kv.k_local_scale is not None and kv.k_local_scale.shape == (2, 20, 2)
    assert kv.k_scale is not None and kv.k_scale.shape == (1, 16, 2)
    spare = slice(16, 20)
    assert not kv.k_local[:, spare].any() and not kv.k_local_scale[:, spare].any()
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    slots = torch.tensor([1, 5, 9])
    for layer in range(3):
        kv.store(layer, slots, k * (layer + 1), v)
    for layer in range(3):
        rk, _ = kv.read(layer, slots)
        torch.testing.assert_close(rk, k * (layer + 1), rtol=0, atol=float((k * (layer + 1)).abs().max()) / 127)
    ks, _ = kv.layer_scales(1)
    assert ks is not None and ks.data_ptr() == kv.k_scale[0].data_ptr()   # the global layer: the global planes


def test_native_and_eager_store_the_same_codes(smollm2):
    """The team's prompt rows and eager's, for the same prompt: the same scales to the rows' fp32 noise (one row
    measured 3e-3 relative apart, the exact path's sums in another order) and codes at
    most one step apart (where the fp32 inputs, summed in another order, sit at a rounding boundary)."""
    prompt = CACHE_PROMPTS[3]
    caches = []
    for eager in (False, True):
        kv = smollm2.new_kv_cache(32, dtype=torch.int8)
        seq = SequenceKV(kv)
        step = prefill_step(seq, prompt, extra=4)
        if eager:
            smollm2.forward(step, kv)
        else:
            CpuTeamDecoder(smollm2, kv, exact=True).forward(step)
        caches.append(kv)
    team, eager = caches
    n = len(prompt)
    torch.testing.assert_close(team.k_scale[:, :n], eager.k_scale[:, :n], rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(team.v_scale[:, :n], eager.v_scale[:, :n], rtol=1e-2, atol=1e-5)
    diff = (team.k[:, :n].int() - eager.k[:, :n].int()).abs()
    assert diff.max().item() <= 1 and (diff > 0).float().mean().item() < 0.05


def test_int8_cache_on_the_native_fast_path(smollm2):
    """Teacher-forced against the eager fp32 step: the fast path's logits over an int8 cache within the fp16
    cache's distance plus a margin for the codes' rounding (measured: median 2.6% against 2.4% relative on
    this model), greedy picks that differ from the fp16 cache's only at near-ties of the reference."""
    # prompts prefilled eagerly (the int8 cache through PagedKVCache.store)
    runs = {"eager": (None, torch.float32), "fast16": (False, torch.float16), "fast8": (False, torch.int8)}
    out = teacher_forced(smollm2, CACHE_PROMPTS, runs, 8)
    rel = {n: sorted(((lt - le).norm() / le.norm()).item() for le, lt in zip(out["eager"], out[n]))
           for n in ("fast16", "fast8")}
    median = {n: r[len(r) // 2] for n, r in rel.items()}
    assert median["fast8"] < 1.5 * median["fast16"] + 5e-3, median
    assert rel["fast8"][-1] < 0.1, rel["fast8"]
    assert_flips_only_at_near_ties(out["eager"], out["fast16"], out["fast8"], "int8 and fp16 caches")


def test_engine_runs_an_int8_cache(smollm2):
    """Through LLM: the budget holds more tokens than fp16's; a long prompt (prefilled eagerly, past the native
    step's chunk) decodes, and its repeat reuses the cached prefix and gives the same tokens."""
    from slipstream import LLM, SamplingParams

    llm = LLM(max_model_len=1024, kv_cache_dtype="int8")
    assert llm.engine.runtime_name == "native" and llm.engine.kv.k.dtype == torch.int8
    prompt = "The history of the city is long and " * 12
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = llm.generate(prompt, params)[0].token_ids
    hits = llm.engine.stats().prefix_cache_hit_tokens
    second = llm.generate(prompt, params)[0].token_ids
    assert llm.engine.stats().prefix_cache_hit_tokens > hits
    assert first == second and len(first) == 12
