"""GGUF's lattice types (IQ1_S/M, IQ2_XXS/XS/S, IQ3_XXS/S), ternary TQ1_0/TQ2_0 and MXFP4.

Their decoding and products are checked per type in tests/kernels/test_cpu_qtypes.py (bit-exact against
gguf-py, on every x86 build via test_isa_builds.py), the file's blocks and the re-encoded planes both. Here,
what a file of them gets:
- every weight type gguf-py decodes is one the loader reads; each keeps every value, re-encoded into the IQ4
  kernels' planes where its blocks allow it, else (or on request, or short of memory) the file's blocks;
- a file with such tensors loads without a warning;
- the grids come from gguf-py, which is imported only for files that hold such types;
- a tiny llama of them gives transformers' greedy tokens (tests/models/test_llama.py, "lattice" and "down_*").
"""
from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as QT

from slipstream.kernels.cpu import load_library, native_available
from slipstream.kernels.cpu.iq_grids import GRID_TYPES, grids
from slipstream.weights.gguf import PACKED_TYPES, RAW_QTYPES, SUPPORTED_TYPES, _linear_from_raw, load_gguf
from slipstream.weights.gguf_file import GGMLType

from support import random_blocks

TYPES = [QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M, QT.TQ1_0, QT.TQ2_0, QT.MXFP4]
N, K = 24, 512


def test_every_type_gguf_py_decodes_is_read():
    decodable = {GGMLType(int(t)) for t in gguf.quants._type_traits if int(t) in GGMLType._value2member_map_}
    assert decodable - {GGMLType.BF16} <= SUPPORTED_TYPES
    assert {GGMLType(int(t)) for t in TYPES} <= RAW_QTYPES - PACKED_TYPES


REENCODED = [QT.IQ2_XXS, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.TQ1_0, QT.TQ2_0, QT.MXFP4, QT.IQ2_XS, QT.IQ2_S, QT.IQ1_M]
PER16 = [QT.IQ2_XS, QT.IQ2_S, QT.IQ1_M]


def _exact(lin, raw, qt):
    ref = gguf.quants.dequantize(raw, qt).reshape(N, K).astype(np.float32)
    assert np.array_equal(lin.dequantize().numpy().view(np.int32), ref.view(np.int32))
    assert np.abs(ref).max() > 0.01   # the blocks are not all zero


@pytest.mark.parametrize("qt", TYPES, ids=[t.name for t in TYPES])
def test_each_type_keeps_every_value(qt, monkeypatch):
    """The types whose weights are one of 16 values times a per-32 scale become 4-bit planes the IQ4 kernels
    read (4.25 bits a weight; MXFP4 4.5), the per-16 ones (IQ2_XS, IQ2_S, IQ1_M) the per-16 IQ planes Q6_K's
    kernels read (4.56); with SLIPSTREAM_IQ_IN_PLACE=1 every type stays the file's blocks. Either way bit-exact
    against gguf-py."""
    raw = random_blocks(int(qt), N, K, seed=int(qt), size=0.05)
    lin = _linear_from_raw(GGMLType(int(qt)), raw, N, K)
    assert lin.format_name == qt.name and (lin.n, lin.k) == (N, K)
    _exact(lin, raw, qt)
    if qt in REENCODED and native_available():
        assert lin.fmt == 100 + int(qt) and lin.reblocked
        assert lin.data.shape == (N, K // 32 * 18 if qt == QT.MXFP4 else K // 256 * (146 if qt in PER16 else 136))
    else:
        assert lin.fmt == int(qt) and lin.data.data_ptr() == raw.ctypes.data   # a view of the file's blocks
    monkeypatch.setenv("SLIPSTREAM_IQ_IN_PLACE", "1")
    kept = _linear_from_raw(GGMLType(int(qt)), raw, N, K)
    assert kept.fmt == int(qt) and kept.data.data_ptr() == raw.ctypes.data
    _exact(kept, raw, qt)


@pytest.mark.skipif(not native_available(), reason="native CPU kernels unavailable")
def test_blocks_the_planes_cannot_hold_stay_in_place(monkeypatch):
    """MXFP4's scale is a power of two from 2^-127 to 2^127, IQ4_NL's an fp16: a matrix with one block out of
    fp16's range keeps the file's blocks (and its values); so does one whose copy would not fit in half the
    memory available."""
    import slipstream.weights.quant as quant
    raw = random_blocks(int(QT.MXFP4), N, K, seed=4, size=0.05)
    raw.reshape(N, -1, 17)[5, 3, 0] = 250   # 2^122
    lin = _linear_from_raw(GGMLType.MXFP4, raw, N, K)
    assert lin.fmt == int(QT.MXFP4)
    _exact(lin, raw, QT.MXFP4)
    raw = random_blocks(int(QT.IQ3_S), N, K, seed=5, size=0.05)
    monkeypatch.setattr(quant, "available_memory", lambda: 2 * N * K // 256 * 136 - 2)
    assert _linear_from_raw(GGMLType.IQ3_S, raw, N, K).fmt == int(QT.IQ3_S)
    monkeypatch.setattr(quant, "available_memory", lambda: 2 * N * K // 256 * 136)
    assert _linear_from_raw(GGMLType.IQ3_S, raw, N, K).fmt == 100 + int(QT.IQ3_S)


def test_the_grids_are_gguf_pys():
    for g, cls in zip(grids(), (gguf.quants.IQ2_XXS, gguf.quants.IQ2_XS, gguf.quants.IQ2_S, gguf.quants.IQ3_XXS,
                                gguf.quants.IQ3_S, gguf.quants.IQ1_S)):
        cls.init_grid()
        assert g.dtype == np.int8 and np.array_equal(g.astype(np.float32), np.asarray(cls.grid).reshape(g.shape))
    assert GRID_TYPES == {int(t) for t in (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M)}


@pytest.mark.skipif(not native_available(), reason="native CPU kernels unavailable")
def test_gguf_is_imported_only_for_files_with_grid_types(tmp_path):
    """The default model (no such types) loads without gguf-py (~0.13 s of imports); a lattice file brings it."""
    path = _tiny_file(tmp_path)
    code = ("import sys\nfrom slipstream.weights import default_model_path\nfrom slipstream.weights.gguf import load_gguf\n"
            "from slipstream.kernels.cpu import load_library\nload_gguf(default_model_path())\n"
            "print('gguf' in sys.modules, load_library().ss_iq_grids_ready())\n"
            f"load_gguf({str(path)!r})\nprint('gguf' in sys.modules, load_library().ss_iq_grids_ready())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "0", "True", "1"], out.stdout + out.stderr[-2000:]


def _tiny_file(tmp_path):
    """IQ3_S ffn_down, IQ2_XXS ffn_up, TQ1_0 attn_output, IQ1_M embeddings (ffn 512)."""
    from support import tiny_llama_gguf
    return tiny_llama_gguf(tmp_path / "m.gguf", {"blk.0.ffn_down": QT.IQ3_S, "blk.0.ffn_up": QT.IQ2_XXS,
                                                 "blk.0.attn_output": QT.TQ1_0, "token_embd": QT.IQ1_M}, ffn=512)


def test_a_file_of_them_loads_in_place_without_a_warning(tmp_path):
    path = _tiny_file(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, weights, reader = load_gguf(path)
    assert not [str(c.message) for c in caught if "IQ" in str(c.message) or "TQ" in str(c.message)]
    layer = weights["layers.0"]
    assert layer.down.format_name == "IQ3_S" and layer.o.format_name == "TQ1_0"
    assert weights["embed"].format_name == "IQ1_M"
    if native_available():   # IQ1_M (per-16 scales): the per-16 IQ planes, a copy out of the map
        lo, hi = reader.data.ctypes.data, reader.data.ctypes.data + reader.data.nbytes
        assert weights["embed"].fmt == 100 + int(QT.IQ1_M) and not lo <= weights["embed"].data.data_ptr() < hi
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ layer.down.dequantize().double().T
    assert torch.allclose(layer.down(x).double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    if load_library() is not None:
        assert load_library().ss_iq_grids_ready() == 1


@pytest.mark.skipif(not native_available(), reason="native CPU kernels unavailable")
def test_the_re_encoded_planes_survive_the_artifact(tmp_path):
    """`slipstream compile` of such a file stores the re-encoded planes (IQ1_M's the per-16 ones) as they are: the
    artifact decodes the GGUF's greedy tokens."""
    from slipstream import LLM, SamplingParams
    from slipstream.compiler import compile_model
    src, out = _tiny_file(tmp_path), tmp_path / "art"
    compile_model(src, out)
    a, b = LLM(src), LLM(out)
    assert b.model.layers[0].down.fmt == a.model.layers[0].down.fmt == 100 + int(QT.IQ3_S)
    assert b.model.embed.fmt == a.model.embed.fmt == 100 + int(QT.IQ1_M)
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in b.generate([[5, 9, 13, 40]], p)] == [o.token_ids for o in a.generate([[5, 9, 13, 40]], p)]


def test_a_file_whose_re_encoding_would_not_fit_stays_in_place_with_one_warning(tmp_path, monkeypatch):
    """The re-encoded planes take 1.2-2.7x the bytes of these types: past half the memory available the whole
    file keeps its blocks (tensor by tensor, a model could otherwise fill the memory before its KV cache), and the
    user is told once; SLIPSTREAM_IQ_IN_PLACE=1 chooses that silently."""
    import slipstream.weights.gguf as g
    path = _tiny_file(tmp_path)
    need = (256 * 512 + 512 * 256 + 256 * 256) * 17 // 32 + 96 * 146   # IQ3_S down, IQ2_XXS up, TQ1_0 o; IQ1_M embed
    monkeypatch.setattr(g, "available_memory", lambda: 2 * need - 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, weights, _ = load_gguf(path)
    said = [str(c.message) for c in caught if "file's blocks" in str(c.message)]
    assert len(said) == 1 and "IQ1_M, IQ2_XXS, IQ3_S, TQ1_0" in said[0], said
    layer = weights["layers.0"]
    assert (layer.down.fmt, layer.o.fmt) == (int(QT.IQ3_S), int(QT.TQ1_0))
    monkeypatch.setattr(g, "available_memory", lambda: 2 * need)
    _, weights, _ = load_gguf(path)
    if native_available():
        assert weights["layers.0"].down.fmt == 100 + int(QT.IQ3_S)
    monkeypatch.setattr(g, "available_memory", lambda: 1000)
    monkeypatch.setenv("SLIPSTREAM_IQ_IN_PLACE", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, weights, _ = load_gguf(path)
    assert not [c for c in caught if "file's blocks" in str(c.message)]
    assert weights["layers.0"].down.fmt == int(QT.IQ3_S)


@pytest.mark.skipif(not native_available(), reason="native CPU kernels unavailable")
@pytest.mark.parametrize("qt", [QT.IQ2_XXS, QT.TQ2_0, QT.MXFP4, QT.IQ2_XS, QT.IQ1_M, QT.Q3_K, QT.Q2_K], ids=lambda t: t.name)
def test_column_cuts_of_the_planes_stay_planes(qt):
    """Tensor parallelism cuts o and down by columns: a re-encoded weight is cut on its planes (it became dense
    fp32), with the values of the file's columns."""
    raw = random_blocks(int(qt), N, 1024, seed=2, size=0.05)
    lin = _linear_from_raw(GGMLType(int(qt)), raw, N, 1024)
    cut = lin.block_cols(256, 768)
    assert cut is not None and cut.fmt == lin.fmt and cut.data.shape[1] == lin.data.shape[1] // 2
    assert torch.equal(cut.dequantize(), lin.dequantize()[:, 256:768])
    assert lin.block_cols(32, 768) is None   # not on the planes' blocks


@pytest.mark.skipif(not native_available(), reason="native CPU kernels unavailable")
def test_an_all_zero_mxfp4_block_does_not_keep_the_matrix_in_place():
    """gguf-py's and llama.cpp's quantizers write e = 0 (2^-128, not an fp16) for a block of zeros: its values are
    +0 whatever the scale, so the planes hold it (d = 0)."""
    w = np.random.default_rng(3).standard_normal((N, K)).astype(np.float32) * 0.05
    w[4, 64:96] = 0
    raw = gguf.quants.quantize(w, QT.MXFP4)
    assert raw.reshape(N, -1, 17)[4, 2, 0] == 0
    lin = _linear_from_raw(GGMLType.MXFP4, raw, N, K)
    assert lin.fmt == 100 + int(QT.MXFP4)
    _exact(lin, raw, QT.MXFP4)
