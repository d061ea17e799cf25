"""The native CPU decode step against the eager torch step, on the embedded SmolLM2 GGUF."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels.cpu import load_library
from slipstream.kv.blocks import SequenceKV
from slipstream.models.llama import LlamaModel
from slipstream.runtime.cpu_native import NativeDecoder
from slipstream.step import decode_step, prefill_step
from slipstream.weights import load_model

pytestmark = pytest.mark.skipif(load_library() is None, reason="native CPU kernels unavailable")


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    m = load_model(None)
    return LlamaModel(m.config, m.weights)


def _prefill(model, kv, seq, ids):
    seq.reserve(len(ids) + 8)
    return model.forward(prefill_step(seq, ids), kv)


def _decode_step(seqs, tokens, positions):
    return decode_step(seqs, tokens, positions, gather=True)


def test_supported(model):
    assert NativeDecoder.unsupported(model) is None


@pytest.mark.parametrize("prompts", [[[1, 504, 3458, 282, 4649]], [[1, 22, 333], [5, 6, 7, 8, 9, 10, 11], [42]]])
def test_native_decode_matches_eager(model, prompts):
    """Two caches fed the same tokens: logits within 1e-3 (they are ~20 in size), same argmax."""
    kv_e, kv_n = model.new_kv_cache(64), model.new_kv_cache(64)
    native = NativeDecoder(model, kv_n)
    seqs_e, seqs_n = [SequenceKV(kv_e) for _ in prompts], [SequenceKV(kv_n) for _ in prompts]
    tokens = []
    for p, se, sn in zip(prompts, seqs_e, seqs_n):
        a, b = _prefill(model, kv_e, se, p), _prefill(model, kv_n, sn, p)
        tokens.append(int(a.argmax()))
        assert int(b.argmax()) == tokens[-1]
    positions = [len(p) for p in prompts]
    for _ in range(6):
        le = model.forward(_decode_step(seqs_e, tokens, positions), kv_e)
        ln = native.forward(_decode_step(seqs_n, tokens, positions))
        assert (le - ln).abs().max().item() < 1e-3
        assert le.argmax(-1).tolist() == ln.argmax(-1).tolist()
        tokens = le.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
