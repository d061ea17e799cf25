"""Packed weights (ggml blocks: Q4_0, Q4_1, Q8_0 and Q4_F32, our re-blocked Q4_K).

- `Linear.dequantize` equals GGUF's formula; the native products (any number of activation rows,
  with and without `accumulate`, with a bias) match a float64 matmul over the dequantized weight
  within 1e-4 relative, as does the torch fallback used when no C compiler is available;
- GGUF round trip: tensors written with gguf.GGUFWriter (gguf-py's own quantizer where it has one,
  hand-made random blocks otherwise: gguf-py cannot quantize Q4_K) and read back with GGUFReader
  dequantize bit for bit as `gguf.quants.dequantize` does;
- `_unpermute` inverts llama.cpp's Q/K row permutation.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as QT

import slipstream.weights.quant as quant
from slipstream.kernels.cpu import native_available
from slipstream.weights.gguf import _linear_from_tensor, _unpermute
from slipstream.weights.quant import BLOCK_BYTES, Q4_0, Q4_1, Q4_F32, Q8_0, Linear, concat_rows

N, K = 40, 256
needs_native = pytest.mark.skipif(not native_available(), reason="native CPU kernels unavailable")
FORMATS = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0, "Q4_F32": Q4_F32}


# -- building packed weights from codes and scales -------------------------------------------------

def random_parts(fmt: int, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Random codes [n, k] (uint8 0..15 or int8) and per-32 scale d / offset m [n, k/32],
    rounded to the precision the block format stores them in."""
    rng = np.random.default_rng(seed)
    g = k // 32
    sign = rng.choice([-1.0, 1.0], (n, g))
    if fmt == Q8_0:
        codes = rng.integers(-128, 128, (n, k)).astype(np.int8)
        d = (rng.uniform(5e-4, 5e-3, (n, g)) * sign).astype(np.float16).astype(np.float32)
        return codes, d, None
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d = rng.uniform(5e-3, 5e-2, (n, g)) * sign
    m = rng.uniform(-0.4, 0.1, (n, g))
    wide = np.float32 if fmt == Q4_F32 else np.float16
    return codes, d.astype(wide).astype(np.float32), (None if fmt == Q4_0 else m.astype(wide).astype(np.float32))


def pack_blocks(fmt: int, codes: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """ggml block bytes [n, k/32 * BLOCK_BYTES[fmt]] for the given codes and scales."""
    n, k = codes.shape
    g = k // 32
    blocks = np.empty((n, g, BLOCK_BYTES[fmt]), np.uint8)
    c = codes.reshape(n, g, 32)
    if fmt == Q8_0:
        blocks[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, g, 2)
        blocks[..., 2:] = c.view(np.uint8)
        return blocks.reshape(n, -1)
    nibbles = c[..., :16] | (c[..., 16:] << 4)  # byte j: element j (low), element j + 16 (high)
    if fmt == Q4_F32:
        blocks[..., 0:4] = d.astype(np.float32).view(np.uint8).reshape(n, g, 4)
        blocks[..., 4:8] = m.astype(np.float32).view(np.uint8).reshape(n, g, 4)
        blocks[..., 8:] = nibbles
    else:
        blocks[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, g, 2)
        if fmt == Q4_1:
            blocks[..., 2:4] = m.astype(np.float16).view(np.uint8).reshape(n, g, 2)
        blocks[..., BLOCK_BYTES[fmt] - 16:] = nibbles
    return blocks.reshape(n, -1)


def expected_weight(fmt: int, codes: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """GGUF's float32 dequantization, written out from the codes and scales."""
    n, k = codes.shape
    q = codes.reshape(n, k // 32, 32).astype(np.float32)
    dd = d[..., None]
    if fmt == Q8_0:
        w = dd * q
    elif fmt == Q4_0:
        w = dd * (q - 8)
    else:
        w = dd * q + m[..., None]
    return w.reshape(n, k).astype(np.float32)


def random_linear(fmt: int, n: int = N, k: int = K, seed: int = 0) -> Linear:
    return Linear.from_blocks(fmt, pack_blocks(fmt, *random_parts(fmt, n, k, seed)), n, k)


LINEARS = {name: (fmt, N, K) for name, fmt in FORMATS.items()}
LINEARS.update({"Q4_1-k96": (Q4_1, 24, 96), "Q8_0-k96": (Q8_0, 24, 96)})  # odd numbers of blocks


@pytest.fixture(scope="module", params=list(LINEARS))
def lin(request) -> Linear:
    fmt, n, k = LINEARS[request.param]
    return random_linear(fmt, n, k, seed=list(LINEARS).index(request.param))


def reference(x: torch.Tensor, lin: Linear) -> torch.Tensor:
    """x @ W.T (+ bias) in float64 over the dequantized float32 weight."""
    y = x.double() @ lin.dequantize().double().T
    return y if lin.bias is None else y + lin.bias.double()


def assert_product_and_accumulate(lin: Linear, rows: int, seed: int) -> None:
    """lin(x) and lin(x, out=base, accumulate=True) both match the float64 reference."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, lin.k, generator=g)
    assert_rel(lin(x), reference(x, lin))
    base = torch.randn(rows, lin.n, generator=g)
    out = base.clone()
    lin(x, out=out, accumulate=True)
    assert_rel(out, reference(x, lin) + base.double())


def assert_rel(y: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} vs scale {scale:.3g}"


# -- construction ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_matches_formula(name: str):
    fmt = FORMATS[name]
    parts = random_parts(fmt, 8, 96, seed=11)
    lin = Linear.from_blocks(fmt, pack_blocks(fmt, *parts), 8, 96)
    assert lin.packed and (lin.n, lin.k) == (8, 96)
    # compute layout: codes plus the scale (and min for 4-bit) per group of 32, fp16 as in the file
    # (Q4_K's scales are products of two scales: fp32); Q4_0 keeps no min plane (-8 x its scales)
    sb = 4 if fmt == Q4_F32 else 2
    planes = 1 if fmt in (Q8_0, Q4_0) else 2
    expected = (8 * 96 if fmt == Q8_0 else 8 * 48) + planes * 8 * 3 * sb
    assert lin.nbytes == expected
    assert (lin.min is None) == (fmt in (Q4_0, Q8_0))
    if fmt == Q4_0:
        assert torch.equal(lin.mins(), lin.scale * -8)
    assert np.array_equal(lin.dequantize().numpy(), expected_weight(fmt, *parts))


def test_from_blocks_rejects_bad_shapes():
    with pytest.raises(ValueError):
        Linear.from_blocks(Q4_0, np.zeros((4, 18), np.uint8), 4, 48)   # K not a multiple of 32
    with pytest.raises(ValueError):
        Linear.from_blocks(Q4_0, np.zeros((4, 20), np.uint8), 4, 32)   # wrong bytes per row


def test_dequantize_rows(lin: Linear):
    rows = torch.tensor([3, 0, 7, 3])
    assert torch.equal(lin.dequantize(rows), lin.dequantize()[rows])
    sub = lin.select_rows(rows)
    assert (sub.fmt, sub.n, sub.k) == (lin.fmt, 4, lin.k)
    assert torch.equal(sub.dequantize(), lin.dequantize()[rows])


# -- products -------------------------------------------------------------------------------------

ROWS = [1, 3, 8, 11, 16, 17, 40]   # the kernel takes activation rows 8 at a time: 11, 17, 40 split


@needs_native
@pytest.mark.parametrize("rows", ROWS)
def test_native_product(lin: Linear, rows: int):
    x = torch.randn(rows, lin.k, generator=torch.Generator().manual_seed(rows))
    assert_rel(lin(x), reference(x, lin))


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_native_accumulate(lin: Linear, rows: int):
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, lin.k, generator=g)
    base = torch.randn(rows, lin.n, generator=g)
    out = base.clone()
    res = lin(x, out=out, accumulate=True)
    assert res is out
    assert_rel(out, reference(x, lin) + base.double())
    # without accumulate the given buffer is overwritten
    out2 = torch.full((rows, lin.n), 1e6)
    lin(x, out=out2)
    assert_rel(out2, reference(x, lin))


@needs_native
@pytest.mark.parametrize("rows", [1, 11])
def test_native_bias(rows: int):
    lin = random_linear(Q4_1, seed=9)
    lin.bias = torch.linspace(-1, 1, lin.n)
    assert_product_and_accumulate(lin, rows, seed=rows)


@needs_native
def test_native_non_contiguous_input(lin: Linear):
    x = torch.randn(lin.k, 5, generator=torch.Generator().manual_seed(3)).T  # a transposed view
    assert not x.is_contiguous()
    assert_rel(lin(x), reference(x, lin))


@pytest.mark.parametrize("rows", [1, 11, 40])
def test_fallback_without_native(lin: Linear, rows: int, monkeypatch):
    """Without a C compiler the product is a dense matmul over the dequantized weight."""
    monkeypatch.setattr(quant, "load_library", lambda: None)
    assert_product_and_accumulate(lin, rows, seed=rows)


def test_fallback_when_kernel_build_fails(monkeypatch, tmp_path):
    """A compiler that fails (or is missing): a warning, then the torch path."""
    from slipstream.kernels.cpu import build
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.delenv("SLIPSTREAM_NO_NATIVE", raising=False)
    build.load_library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="native CPU kernels unavailable"):
            assert build.load_library() is None
        assert not native_available()
        lin = random_linear(Q8_0, n=8, k=64)
        x = torch.randn(2, 64)
        assert_rel(lin(x), reference(x, lin))
    finally:
        build.load_library.cache_clear()  # the next caller builds (or finds) the real library


@needs_native
def test_native_float64_input():
    lin = random_linear(Q8_0, n=8, k=64)
    x = torch.randn(2, 64, dtype=torch.float64)
    assert_rel(lin(x), reference(x, lin))


@needs_native
def test_native_non_contiguous_out():
    lin = random_linear(Q8_0, n=8, k=64)
    x = torch.randn(2, 64)
    out = torch.zeros(lin.n, 2).T
    lin(x, out=out)
    assert_rel(out, reference(x, lin))


def test_dense_linear_never_calls_native(monkeypatch):
    monkeypatch.setattr(quant, "load_library", lambda: pytest.fail("native kernel used"))
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(12, 64, generator=g), torch.randn(12, generator=g)
    lin = Linear.dense(w, b)
    assert not lin.packed
    for rows in (1, 20):
        x = torch.randn(rows, 64, generator=g)
        assert torch.allclose(lin(x), x @ w.T + b, atol=1e-5)
        out = torch.ones(rows, 12)
        lin(x, out=out, accumulate=True)
        assert torch.allclose(out, x @ w.T + b + 1, atol=1e-5)


def test_concat_rows():
    a, b = random_linear(Q4_1, n=8, seed=1), random_linear(Q4_1, n=16, seed=2)
    cat = concat_rows([a, b])
    assert cat.fmt == Q4_1 and cat.n == 24
    assert torch.equal(cat.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    c = random_linear(Q8_0, n=4, seed=3)
    c.bias = torch.arange(4.0)
    mixed = concat_rows([a, c])  # different layouts: each part kept as it is, stacked
    assert mixed.parts is not None and [p.fmt for p in mixed.parts] == [Q4_1, Q8_0] and mixed.n == 12
    assert torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), c.dequantize()]))
    x = torch.randn(3, a.k, generator=torch.Generator().manual_seed(4))
    ref = x @ mixed.dequantize().T + mixed.bias
    assert torch.allclose(mixed(x), ref, atol=1e-4)
    assert torch.equal(mixed.bias, torch.cat([torch.zeros(8), torch.arange(4.0)]))


# -- GGUF blocks ----------------------------------------------------------------------------------

GGML_BLOCKS = {QT.Q4_0: (32, 18), QT.Q4_1: (32, 20), QT.Q8_0: (32, 34), QT.Q4_K: (256, 144)}


def _fp16_bytes(rng: np.random.Generator, shape: tuple, lo: float, hi: float, signed: bool) -> np.ndarray:
    v = rng.uniform(lo, hi, shape)
    if signed:
        v *= rng.choice([-1.0, 1.0], shape)
    return v.astype(np.float16).view(np.uint8).reshape(shape[:-1] + (2 * shape[-1],))


def random_blocks(qt: QT, n: int, k: int, seed: int) -> np.ndarray:
    """Raw ggml blocks with every code pattern possible: random bytes, sane fp16 scales."""
    rng = np.random.default_rng(seed)
    bs, nbytes = GGML_BLOCKS[qt]
    nb = k // bs
    blocks = rng.integers(0, 256, (n, nb, nbytes), dtype=np.uint8)
    if qt == QT.Q4_K:  # d, dmin (fp16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        blocks[..., 0:4] = _fp16_bytes(rng, (n, nb, 2), 1e-3, 5e-2, signed=False)
    elif qt == QT.Q4_1:  # d, m (fp16), 16 bytes of nibbles
        blocks[..., 0:4] = _fp16_bytes(rng, (n, nb, 2), 1e-3, 5e-2, signed=True)
    else:  # d (fp16) then codes
        blocks[..., 0:2] = _fp16_bytes(rng, (n, nb, 1), 1e-3, 5e-2, signed=True)
    return blocks.reshape(n, nb * nbytes)


def quantized_blocks(qt: QT, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, qt)


def _can_quantize(qt: QT) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, GGML_BLOCKS[qt][0]), np.float32), qt)
        return True
    except NotImplementedError:
        return False


CASES = [(qt, src) for qt in GGML_BLOCKS for src in ("quantize", "random")
         if src == "random" or _can_quantize(qt)]
SHAPES = {QT.Q4_0: (40, 96), QT.Q4_1: (24, 128), QT.Q8_0: (16, 64), QT.Q4_K: (6, 512)}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "blocks.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for i, (qt, src) in enumerate(CASES):
        n, k = SHAPES[qt]
        data = quantized_blocks(qt, n, k, i) if src == "quantize" else random_blocks(qt, n, k, i)
        w.add_tensor(f"{qt.name}.{src}", data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_tensors(gguf_file: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(gguf_file)).tensors}


def test_gguf_py_quantizes_the_simple_formats():
    """The round trip below covers gguf-py-quantized Q4_0/Q4_1/Q8_0 (Q4_K only from random blocks)."""
    assert {qt for qt, src in CASES if src == "quantize"} >= {QT.Q4_0, QT.Q4_1, QT.Q8_0}


@pytest.mark.parametrize("qt,src", CASES, ids=[f"{q.name}-{s}" for q, s in CASES])
def test_gguf_dequantize_bit_exact(gguf_tensors: dict, qt: QT, src: str):
    t = gguf_tensors[f"{qt.name}.{src}"]
    n, k = SHAPES[qt]
    assert QT(t.tensor_type) == qt and [int(s) for s in t.shape] == [k, n]
    lin = _linear_from_tensor(t)
    assert lin.fmt == (Q4_F32 if qt == QT.Q4_K else int(qt)) and (lin.n, lin.k) == (n, k)
    ours = lin.dequantize().numpy()
    ref = gguf.quants.dequantize(np.asarray(t.data), qt).reshape(n, k).astype(np.float32)
    assert np.isfinite(ref).all()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))  # bit for bit


@needs_native
@pytest.mark.parametrize("qt,src", CASES, ids=[f"{q.name}-{s}" for q, s in CASES])
def test_gguf_native_product(gguf_tensors: dict, qt: QT, src: str):
    lin = _linear_from_tensor(gguf_tensors[f"{qt.name}.{src}"])
    x = torch.randn(3, lin.k, generator=torch.Generator().manual_seed(1))
    assert_rel(lin(x), reference(x, lin))


# -- llama.cpp's Q/K permutation ------------------------------------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to q_proj / k_proj rows for the llama architecture."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("n_head,head_dim", [(4, 16), (2, 16), (1, 8), (3, 24)])
def test_unpermute_inverts_llama_cpp(n_head: int, head_dim: int):
    rows, cols = n_head * head_dim, 32
    w = np.random.default_rng(n_head).standard_normal((rows, cols)).astype(np.float32)
    converted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(converted, w)
    back = _unpermute(Linear.dense(torch.from_numpy(converted)), n_head)
    assert torch.equal(back.dequantize(), torch.from_numpy(w))


def test_unpermute_packed_rows_and_bias():
    n_head, head_dim = 2, 16
    q = random_linear(Q4_0, n=n_head * head_dim, k=64, seed=4)
    q.bias = torch.randn(q.n)
    w, b = q.dequantize().numpy(), q.bias.numpy()
    conv = q.select_rows(torch.from_numpy(llama_cpp_permute(np.arange(q.n)[:, None], n_head)[:, 0]))
    assert np.array_equal(conv.dequantize().numpy(), llama_cpp_permute(w, n_head))
    back = _unpermute(conv, n_head)
    assert back.fmt == Q4_0
    assert np.array_equal(back.dequantize().numpy(), w)
    assert np.array_equal(back.bias.numpy(), b)


@needs_native
def test_widen_equals_dequantize(lin: Linear):
    """The native widening used for prefill gives GGUF's dequantized values exactly."""
    from slipstream.kernels.cpu import load_library

    assert torch.equal(lin.widen(load_library()), lin.dequantize())


@needs_native
def test_blas_modes():
    """Within `blas_mode` a long chunk's product (the BLAS path) runs as asked: "bf16" rounds weights and
    activations to bf16 (within bf16's precision of the fp32 product, not equal to it); "fp32-fixed" multiplies
    BLAS_ROWS rows per call, so a row's result is the same beside other rows, bit for bit; short chunks (the
    matvec kernels) are untouched either way. An unknown mode is refused."""
    from slipstream.weights.quant import BLAS_ROWS, DENSE_FROM_ROWS, blas_mode
    fmt = FORMATS["Q4_1"]
    lin = Linear.from_blocks(fmt, pack_blocks(fmt, *random_parts(fmt, 64, 256, seed=3)), 64, 256)
    lin.bias = torch.randn(64)
    x = torch.randn(DENSE_FROM_ROWS + BLAS_ROWS, 256, generator=torch.Generator().manual_seed(2))
    ref = lin(x)
    with blas_mode("bf16"):
        y, short = lin(x), lin(x[:4])
    assert y.dtype == torch.float32 and not torch.equal(y, ref)
    assert (y - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert torch.equal(short, lin(x[:4]))
    with blas_mode("bf16", dense_from_rows=4):   # the step's threshold (16-bit float models: execute.py)
        short_blas, three = lin(x[:4]), lin(x[:3])
        assert quant.dense_from_rows() == 4
    assert quant.dense_from_rows() == DENSE_FROM_ROWS
    assert not torch.equal(short_blas, short) and (short_blas - short).abs().max() <= 2e-2 * short.abs().max()
    assert torch.equal(three, lin(x[:3]))
    # "fp32-fixed": a row beside 32 to 300 others, packed and dense (a shape where one BLAS call per chunk gives
    # the row different bits from 129 rows on: this fails with "fp32")
    big = Linear.from_blocks(fmt, pack_blocks(fmt, *random_parts(fmt, 2048, 1024, seed=4)), 2048, 1024)
    dense = Linear.dense(torch.randn(2048, 1024, generator=torch.Generator().manual_seed(5)) * 0.03)
    rows = torch.randn(300, 1024, generator=torch.Generator().manual_seed(6))
    for w in (big, dense):
        with blas_mode("fp32-fixed"):
            got = [w(rows[:total])[0] for total in (33, 64, 129, 200, 300)]
        assert all(torch.equal(g, got[0]) for g in got)
        assert torch.allclose(got[0], w(rows[:1])[0], atol=1e-3)
    with pytest.raises(ValueError, match="unknown BLAS mode"):
        with blas_mode("fp16"):
            pass
