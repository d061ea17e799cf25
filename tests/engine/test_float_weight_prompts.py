"""Prompts of a model with 16-bit float weights (an F16 GGUF file) on the fast path: the native step multiplies
such weights one row at a time, so chunks from `CpuTeamDecoder.float_eager_from` tokens on run on the eager
BLAS step where it multiplies in bf16 (AMX, AVX-512 BF16), from `dense_eager_from` where in fp32, shorter ones on
the native step; a chunk's path is decided by its own length,
never by the chunks beside it. The exact path keeps its usual split."""
import numpy as np
import pytest
from support import engine, tiny_llama_gguf
from test_engine import assert_idle, drain, greedy

from slipstream import LLM
from slipstream.engine.request import Request
from slipstream.runtime.cpu_team import CpuTeamDecoder
from slipstream.weights import quant


@pytest.fixture(scope="module")
def f16_llm(tmp_path_factory):
    path = tiny_llama_gguf(tmp_path_factory.mktemp("f16") / "f16.gguf", {}, size=0.08, floats="float16")
    return LLM(str(path))


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 96, size=n).tolist()


def test_float_weight_prompts_from_16_tokens_run_eagerly(f16_llm, monkeypatch):
    e = engine(f16_llm, prefill_chunk=512, exact=False, enable_prefix_cache=False)
    assert e.runtime.name == "native"
    bf16 = e.runtime.eager_blas == "bf16"
    start = CpuTeamDecoder.float_eager_from if bf16 else CpuTeamDecoder.dense_eager_from
    assert start <= 32 and e.runtime.prefill_tokens == start - 1 and e.executor.dense_from_rows == start
    seen, thresholds = [], []
    inner, forward = e.executor.prefill_batches, e.executor.model.forward
    monkeypatch.setattr(e.executor, "prefill_batches", lambda chunks: seen.append(inner(chunks)) or seen[-1])

    def spy(step, kv, **kw):
        thresholds.append(quant.dense_from_rows())
        return forward(step, kv, **kw)
    monkeypatch.setattr(e.executor.model, "forward", spy)
    long, short = Request(_prompt(40, 1), greedy(6, ignore_eos=True)), Request(_prompt(10, 2), greedy(6, ignore_eos=True))
    for r in (long, short):   # one after the other: prompts that arrive together share one prefill plan
        e.add_request(r)
        drain(e, [r])
    batches = [b for bs in seen for b in bs]
    by_size = {sum(end - s for _, s, end in b.chunks): b for b in batches}
    assert not by_size[40].on_runtime and not by_size[40].matvec   # eager, BLAS products
    assert by_size[10].on_runtime                                     # the native step
    assert thresholds and all(t == start for t in thresholds)        # the eager step used the same threshold
    assert quant.dense_from_rows() == quant.DENSE_FROM_ROWS             # and left it as it was
    assert len(long.output_ids) == len(short.output_ids) == 6
    assert_idle(e)

    # the long prompt's tokens are the same beside another long prompt (one eager batch) as alone
    def run(prompts):
        eng = engine(f16_llm, prefill_chunk=512, exact=False, enable_prefix_cache=False)
        reqs = [Request(p, greedy(6, ignore_eos=True)) for p in prompts]
        for r in reqs:
            eng.add_request(r)
        drain(eng, reqs)
        return reqs[0].output_ids
    assert run([_prompt(40, 1), _prompt(34, 3)]) == run([_prompt(40, 1)]) == long.output_ids


def test_the_exact_path_keeps_its_split(f16_llm):
    e = engine(f16_llm, exact=True)
    assert e.runtime.prefill_tokens == CpuTeamDecoder.prefill_tokens
    assert e.executor.dense_from_rows == quant.DENSE_FROM_ROWS
