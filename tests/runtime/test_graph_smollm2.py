"""The graph runtime's step (uncaptured, under Triton's interpreter on CPU) against the eager step, on
the first two layers of the embedded SmolLM2 GGUF: real Q4_1-packed weights through the int4 matvec
with the fused norm and SwiGLU, and a dense copy of them."""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton")

from support import decode_step, prefill_step, skip_unless_default_model  # noqa: E402

from slipstream.kv.blocks import SequenceKV  # noqa: E402
from slipstream.models.llama import LlamaModel  # noqa: E402
from slipstream.runtime.graph import GraphDecoder  # noqa: E402
from slipstream.weights import load_model  # noqa: E402
from slipstream.weights.quant import Linear  # noqa: E402

LAYERS, VOCAB = 2, 4096   # the first layers and tokens: the interpreter runs every program in Python


def _rows(w: Linear, n: int) -> Linear:
    cut = lambda t: None if t is None else t[:n].contiguous()  # noqa: E731
    return Linear(n, w.k, cut(w.data), w.fmt, cut(w.scale), cut(w.min), cut(w.bias))


def _small(dense: bool) -> LlamaModel:
    m = load_model(None)
    cfg = dataclasses.replace(m.config, num_layers=LAYERS, vocab_size=VOCAB)
    w = {k: v for k, v in m.weights.items() if not k.startswith("layers.") or int(k.split(".")[1]) < LAYERS}
    w["embed"] = w["lm_head"] = _rows(w["embed"], VOCAB)
    if dense:   # the same numbers as plain float32 matrices: the dense matvec path
        def d(x):
            return Linear.dense(x.dequantize(), x.bias) if isinstance(x, Linear) else x
        w = {k: ({kk: d(vv) for kk, vv in v.items()} if isinstance(v, dict) else d(v)) for k, v in w.items()}
        w["lm_head"] = w["embed"]
    return LlamaModel(cfg, w)


@pytest.fixture(scope="module", params=["q4_1", "dense"])
def model(request) -> LlamaModel:
    skip_unless_default_model()
    return _small(request.param == "dense")


def test_triton_decode_matches_eager(model):
    prompts = [[1, 504, 3458, 282, 409], [5, 6, 7] * 7 + [8]]   # the second spans two KV blocks
    kv_e, kv_t = model.new_kv_cache(16), model.new_kv_cache(16)
    tri = GraphDecoder(model, kv_t, max_batch=2, max_context=64, capture=False)
    seqs_e, seqs_t = [SequenceKV(kv_e) for _ in prompts], [SequenceKV(kv_t) for _ in prompts]
    seqs_t[0].reserve(1)   # different block layouts in the two caches: the block tables differ
    tokens = []
    for p, se, st in zip(prompts, seqs_e, seqs_t):
        outs = []
        for kv, s in ((kv_e, se), (kv_t, st)):
            outs.append(model.forward(prefill_step(s, p, extra=4), kv))
        tokens.append(int(outs[0].argmax()))
    positions = [len(p) for p in prompts]
    for _ in range(2):
        le = model.forward(decode_step(seqs_e, tokens, positions), kv_e)
        lt = tri.forward(decode_step(seqs_t, tokens, positions))
        # 2 rows take the matvec's tensor-core path: activations (and int4 weights) as bf16 hi + lo parts,
        # about 16 mantissa bits; logits of about 40 then differ by a few 1e-3 after the layers (argmax equal)
        assert (le - lt).abs().max().item() < 5e-3, (le - lt).abs().max().item()
        assert le.argmax(-1).tolist() == lt.argmax(-1).tolist()
        tokens = le.argmax(-1).tolist()
        positions = [q + 1 for q in positions]
