"""The engine with each decode-step runtime: the same greedy tokens as the eager step under
continuous batching (requests of different lengths join and leave, batches get padded to buckets).
On a CPU the Triton runtimes run under Triton's interpreter, on a tiny random model."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from support import skip_unless_default_model  # noqa: E402

from slipstream import LLM, SamplingParams  # noqa: E402
from slipstream.engine.config import EngineConfig  # noqa: E402
from slipstream.engine.engine import Engine  # noqa: E402
from slipstream.engine.request import Request  # noqa: E402
from slipstream.errors import SlipstreamError  # noqa: E402
from slipstream.models.random_init import random_llama, shape_config  # noqa: E402

PROMPTS = [[1, 30, 31, 32, 33], [1, 40, 41], [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65]]
MAX_TOKENS = [6, 3, 5]


@pytest.fixture(scope="module")
def tokenizer():
    skip_unless_default_model()
    return LLM(kv_cache_tokens=256).tokenizer


def _tokens(runtime: str, tokenizer, logprobs: int | None = None) -> list[list[int]]:
    model = random_llama(shape_config("tiny", vocab_size=512), seed=7)
    e = Engine(model, tokenizer, EngineConfig(runtime=runtime, max_batch=4, kv_cache_tokens=512, block_size=4,
                                              max_model_len=128))
    assert e.runtime_name == runtime
    reqs = [Request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs))
            for p, n in zip(PROMPTS, MAX_TOKENS)]
    modes: list[bool] = []
    if e.runtime.name != "eager":    # record which decode path each step took
        forward = e.runtime.forward
        e.runtime.forward = lambda step, tokens_only=False: (modes.append(tokens_only), forward(step, tokens_only))[1]
    for _ in e.run(reqs):
        pass
    assert not e.has_unfinished()
    if e.runtime.name != "eager":    # greedy rows take the device's argmax unless logprobs need the logits
        assert modes and all(m == (logprobs is None) for m in modes)
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("runtime", ["graph", "megakernel"])
def test_runtime_greedy_tokens_equal_eager(runtime, tokenizer):
    if runtime == "megakernel":
        pytest.importorskip("slipstream.runtime.megakernel")
    want = _tokens("eager", tokenizer)
    assert [len(t) for t in want] == MAX_TOKENS
    assert _tokens(runtime, tokenizer) == want                 # greedy chosen on the device
    assert _tokens(runtime, tokenizer, logprobs=1) == want     # logits copied, sampled on the host


def test_gpu_runtimes_refuse_a_cpu_without_the_interpreter(tokenizer, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("TRITON_INTERPRET")
    model = random_llama(shape_config("tiny", vocab_size=512), seed=7)
    with pytest.raises(SlipstreamError, match="needs a CUDA GPU"):
        Engine(model, tokenizer, EngineConfig(runtime="graph", kv_cache_tokens=256))
    with pytest.raises(ValueError, match="unknown runtime"):
        Engine(model, tokenizer, EngineConfig(runtime="warp", kv_cache_tokens=256))
