"""GGUF tensor types no kernel reads (IQ1-IQ3, ternary TQ1_0/TQ2_0, MXFP4): re-encoded once at load as Q8_0.

- each type's tensor, decoded by gguf-py, lands within half a Q8_0 step (plus its scale's fp16 rounding) of the file's values, block by
  block, and equals gguf-py's own Q8_0 re-encoding of them bit for bit;
- the native product over the repacked weight matches a float64 matmul over its dequantized values;
- loading a file with such tensors names the types, the weights affected and the memory in one warning;
- a tiny llama file of these types gives transformers' greedy tokens on the native runtime
  (tests/models/test_llama.py, variant "repacked").
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as QT

from slipstream.kernels.cpu import native_available
from slipstream.weights.gguf import REPACKED_TYPES, _linear_from_raw, load_gguf
from slipstream.weights.gguf_file import GGMLType
from slipstream.weights.quant import Q8_0

from support import random_blocks

TYPES = sorted(REPACKED_TYPES, key=int)
N, K = 24, 512


def test_every_type_gguf_py_decodes_but_no_kernel_reads_is_repacked():
    """The set is what gguf-py can decode among the file types ggml writes for weights, less ours."""
    from slipstream.weights.gguf import PACKED_TYPES, RAW_QTYPES
    assert not REPACKED_TYPES & (PACKED_TYPES | RAW_QTYPES)
    decodable = {GGMLType(int(t)) for t in gguf.quants._type_traits if int(t) in GGMLType._value2member_map_}
    assert decodable - {GGMLType.BF16} <= PACKED_TYPES | RAW_QTYPES | REPACKED_TYPES


@pytest.mark.parametrize("qt", TYPES, ids=[t.name for t in TYPES])
def test_repacked_values_are_within_half_a_q8_step(qt):
    raw = random_blocks(int(qt), N, K, seed=int(qt), size=0.05)
    file_values = gguf.quants.dequantize(raw, QT(int(qt))).reshape(N, K).astype(np.float32)
    lin = _linear_from_raw(qt, raw, N, K)
    assert lin.fmt == Q8_0 and (lin.n, lin.k) == (N, K)
    ours = lin.dequantize().numpy()
    again = gguf.quants.dequantize(gguf.quants.quantize(file_values, QT.Q8_0), QT.Q8_0).reshape(N, K)
    assert np.array_equal(ours, again)
    d = np.abs(file_values).reshape(N, K // 32, 32).max(-1, keepdims=True) / 127
    d16 = d.astype(np.float16).astype(np.float32)   # the scale as Q8_0 stores it (subnormal for tiny blocks)
    err = np.abs(ours - file_values).reshape(N, K // 32, 32)
    # half a step, plus the scale's fp16 rounding times a code of up to 127
    assert (err <= (0.5 * d16 + 127 * np.abs(d - d16)) * 1.001 + 1e-9).all()
    assert np.abs(file_values).max() > 0.01   # the blocks are not all zero


@pytest.mark.skipif(not native_available(), reason="native CPU kernels unavailable")
@pytest.mark.parametrize("qt", [QT.IQ2_XXS, QT.IQ3_S, QT.MXFP4], ids=["IQ2_XXS", "IQ3_S", "MXFP4"])
def test_the_native_product_of_a_repacked_weight(qt):
    raw = random_blocks(int(qt), N, K, seed=3, size=0.05)
    lin = _linear_from_raw(GGMLType(int(qt)), raw, N, K)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ lin.dequantize().double().T
    got = lin(x).double()
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def _tiny_file(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for key, value in dict(block_count=1, context_length=64, embedding_length=256, feed_forward_length=512,
                           head_count=4, head_count_kv=4, vocab_size=64).items():
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-6)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (64, 256), "blk.0.attn_q": (256, 256), "blk.0.attn_k": (256, 256),
              "blk.0.attn_v": (256, 256), "blk.0.attn_output": (256, 256), "blk.0.ffn_gate": (512, 256),
              "blk.0.ffn_up": (512, 256), "blk.0.ffn_down": (256, 512)}
    types = {"blk.0.ffn_down": QT.IQ3_S, "blk.0.ffn_up": QT.IQ2_XXS}
    for name, (n, k) in shapes.items():
        if name in types:
            w.add_tensor(name + ".weight", random_blocks(int(types[name]), n, k, size=0.05), raw_dtype=types[name])
        else:
            w.add_tensor(name + ".weight", (rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        w.add_tensor(name + ".weight", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp_path / "m.gguf"


def test_loading_names_the_repacked_types_once(tmp_path):
    _tiny_file(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, weights, _ = load_gguf(tmp_path / "m.gguf")
    said = [str(c.message) for c in caught if "Q8_0" in str(c.message)]
    assert len(said) == 1 and "IQ2_XXS, IQ3_S" in said[0] and "262,144 of them" in said[0]
    assert "0.3 MiB" in said[0]
    layer = weights["layers.0"]
    assert layer.down.fmt == Q8_0


def test_a_re_encoding_that_cannot_fit_is_refused_before_it_starts(tmp_path, monkeypatch):
    """Q8_0 takes 2.5-5x an IQ file's bytes: past the memory available, one clear error instead of the OOM killer."""
    import slipstream.weights.gguf as g
    from slipstream.errors import ModelLoadError
    path = _tiny_file(tmp_path)
    monkeypatch.setattr(g, "available_memory", lambda: 100_000)   # 0.1 MB; the re-encoding needs 0.28 MB
    with pytest.raises(ModelLoadError, match=r"IQ2_XXS, IQ3_S .*0\.0 GiB; 0\.0 GiB of memory is available"):
        load_gguf(path)
    monkeypatch.setattr(g, "available_memory", lambda: None)   # unknown (not Linux): no check
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, weights, _ = load_gguf(path)
    assert weights["layers.0"].down.fmt == Q8_0
