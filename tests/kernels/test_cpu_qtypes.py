"""Every ggml block type read in place (kernels/cpu/qtypes.h): decoding bit-exact against gguf-py's
reference dequantization, and the native products (exact and fast paths) against torch over the
dequantized weights, including matrices stacked from parts of different types."""
from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import support
import torch
from gguf import GGMLQuantizationType as QT

from slipstream.kernels.cpu import load_library
from slipstream.weights.gguf import _q4k_linear
from slipstream.weights.quant import REENCODE, RAW_TYPES, Linear, concat_rows

lib = load_library()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: native kernels unavailable")

BLOCK_TYPES = [QT(t) for t, (_, qk, _) in RAW_TYPES.items() if qk > 1] + [QT.Q4_0, QT.Q4_1, QT.Q8_0]


def random_blocks(qt: QT, n: int, k: int, seed: int = 0):
    return support.random_blocks(int(qt), n, k, seed)


def as_linear(qt: QT, blocks: np.ndarray, n: int, k: int, reblock: bool = True) -> Linear:
    if int(qt) in RAW_TYPES:
        return Linear.from_raw(int(qt), blocks, n, k, reblock=reblock)
    return Linear.from_blocks(int(qt), blocks, n, k)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


@pytest.mark.parametrize("qt", BLOCK_TYPES, ids=lambda t: t.name)
def test_decoding_is_bit_exact(qt: QT) -> None:
    n, k = 5, 512
    blocks = random_blocks(qt, n, k, seed=int(qt))
    ref = gguf.quants.dequantize(blocks, qt).reshape(n, k)
    got = as_linear(qt, blocks, n, k).dequantize().numpy()
    assert np.array_equal(bits(got), bits(ref))
    # the embedding path decodes single rows natively
    out = np.empty(k, np.float32)
    if int(qt) in RAW_TYPES:
        lib.ss_qt_dequant(int(qt), blocks[3:].ctypes.data, 0, 1, k, out.ctypes.data)
        assert np.array_equal(bits(out), bits(ref[3]))


@pytest.mark.parametrize("d", [0x0000, 0x8000], ids=["+0", "-0"])
def test_a_zero_scale_keeps_its_zeros_signs(d: int) -> None:
    """A Q3_K block with d = +-0: its weights are zeros whose sign is d's times its (possibly negative) sc - 32's,
    and the per-16 planes keep those signs too (a reviewer found +0 for -0 there)."""
    n, k = 3, 512
    blocks = random_blocks(QT.Q3_K, n, k, seed=4)
    blocks.reshape(n, -1, 110)[:, 1, 108:110] = np.array([d], np.uint16).view(np.uint8)
    w = as_linear(QT.Q3_K, blocks, n, k)
    assert w.reblocked
    ref = gguf.quants.dequantize(blocks, QT.Q3_K).reshape(n, k)
    assert np.array_equal(bits(w.dequantize().numpy()), bits(ref))


@pytest.mark.parametrize("qt", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.F16, QT.BF16],
                         ids=lambda t: t.name)
def test_gguf_quantizer_output_decodes_exactly(qt: QT) -> None:
    """Weights quantized by gguf-py's own quantizers, as a converter writes them."""
    rng = np.random.default_rng(1)
    n, k = 6, 256
    w = rng.standard_normal((n, k)).astype(np.float32)
    q = gguf.quants.quantize(w, qt)
    ref = gguf.quants.dequantize(q, qt).reshape(n, k)
    got = as_linear(qt, q.view(np.uint8).reshape(n, -1), n, k).dequantize().numpy()
    assert np.array_equal(bits(got), bits(ref))


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the fast path sees it: int8 codes times their per-32 scales."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    d, s = torch.empty(rows, k // 32), torch.empty(rows, k // 32)
    lib.ss_quantize(x.data_ptr(), rows, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return (q.view(rows, k // 32, 32).float() * d[..., None]).view(rows, k)


def native_product(w: Linear, x: torch.Tensor, exact: bool) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.n)
    lib.ss_matmul(ctypes.byref(w.ss_mat()), x.shape[0], x.data_ptr(), y.data_ptr(), int(exact))
    return y


# the re-encoded types (weights/quant.py REENCODE) also as the file's blocks (iqtypes.h's decoders), which they
# stay with SLIPSTREAM_IQ_IN_PLACE=1 or short of memory
PRODUCT_CASES = [(QT(t), True) for t in RAW_TYPES] + [(QT(t), False) for t in REENCODE]


@pytest.mark.parametrize("qt,reblock", PRODUCT_CASES, ids=lambda c: c.name if isinstance(c, QT) else
                         ("" if c else "in-place"))
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_native_products(qt: QT, reblock: bool, rows: int) -> None:
    n, k = 7, 512
    if qt in (QT.F16, QT.BF16):
        w32 = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
        blocks = w32.to(torch.float16 if qt == QT.F16 else torch.bfloat16).view(torch.uint8).numpy()
    else:
        blocks = random_blocks(qt, n, k, seed=3)
    w = as_linear(qt, blocks, n, k, reblock)
    assert w.reblocked == (reblock and int(qt) in REENCODE) or int(qt) not in REENCODE
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4))
    ref = x.double() @ w.dequantize().double().T
    scale = ref.abs().max().item()
    exact = native_product(w, x, exact=True)
    assert torch.allclose(exact.double(), ref, rtol=1e-4, atol=1e-4 * scale)
    # the fast path multiplies the int8-quantized activations: exactly those, up to fp32 rounding
    fast = native_product(w, x, exact=False)
    # (F16 and BF16 rows always take fp32 activations)
    ref_q = ref if qt in (QT.F16, QT.BF16) else quantized(x).double() @ w.dequantize().double().T
    assert torch.allclose(fast.double(), ref_q, rtol=1e-4, atol=1e-4 * scale)
    assert torch.allclose(w(x).double(), ref, rtol=1e-4, atol=1e-4 * scale)   # the Linear's own call
    res = torch.randn(rows, n)
    got = w(x, out=res.clone(), accumulate=True)   # a residual add
    assert torch.allclose(got.double(), ref + res.double(), rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("qt", [QT(t) for t in RAW_TYPES if t not in (1, 30)], ids=lambda t: t.name)
def test_widening_to_bf16_is_the_fp32_widening_rounded(qt: QT) -> None:
    """The eager step's bf16 products (quant.blas_mode) widen GGUF block types straight to bf16, row by row
    across threads: the very bits of the fp32 widening cast by torch (the raw and the re-blocked layout)."""
    from slipstream.kernels.cpu import load_library
    lib = load_library()
    n, k = 37, 512
    for reblock in (True, False):
        w = Linear.from_raw(int(qt), random_blocks(qt, n, k, seed=9), n, k, reblock=reblock)
        assert torch.equal(w.widen_bf16(lib).view(torch.int16), w.widen(lib).to(torch.bfloat16).view(torch.int16))
    wide = np.asarray(random_blocks(qt, n, 2 * k, seed=10)).reshape(n, -1)   # rows as a view of wider rows
    view = Linear.from_raw(int(qt), wide[:, :wide.shape[1] // 2], n, k, reblock=False)
    assert torch.equal(view.widen_bf16(lib), view.widen(lib).to(torch.bfloat16))
    kq = _q4k_linear(random_blocks(QT.Q4_K, 16, k, seed=5), 16, k)   # a 4-bit layout: widened, then cast
    both = concat_rows([kq, w])
    assert torch.equal(both.widen_bf16(lib), torch.cat([kq.widen(lib), w.widen(lib)]).to(torch.bfloat16))


@pytest.mark.parametrize("qt", [QT.F16, QT.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [512, 100, 3])
def test_float_weights_to_bf16(qt: QT, k: int) -> None:
    """F16 and BF16 weights for the eager bf16 step: BF16 rows as they are, F16 rows rounded to nearest, ties to
    even (the vector bodies and the scalar tail alike): torch's fp32 widening cast to bf16, a NaN kept a NaN."""
    lib = load_library()
    n = 37
    dt = torch.float16 if qt == QT.F16 else torch.bfloat16
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 3).to(dt)
    w[0, :3] = torch.tensor([float("inf"), -0.0, float("nan")])
    w[1, :2] = torch.tensor([-float("inf"), 6e-8 if qt == QT.F16 else 1e-30])
    w.view(torch.int16)[2, 0] = -1   # a NaN with a payload
    if qt == QT.F16:
        w[3] = 1 + 2 ** -8 + 2 ** -9   # halfway between two bf16 values with an odd last bit (rounds up)
        w[4] = 1 + 2 ** -9             # halfway, even last bit (rounds down)
    raw = w.contiguous().view(torch.uint8).numpy()
    for lin in (Linear.from_raw(int(qt), raw, n, k, reblock=False),
                Linear.from_raw(int(qt), np.concatenate([raw, raw], axis=1)[:, :2 * k], n, k, reblock=False)):
        got, ref = lin.widen_bf16(lib), w.float().to(torch.bfloat16)
        nan = torch.isnan(ref.float())
        assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
        assert torch.isnan(got.float()[nan]).all() and nan.sum() >= 2


def test_stacked_parts_of_different_types() -> None:
    """A Q4_K_M-style fused QKV: Q/K re-blocked from Q4_K, V raw Q6_K, plus an F32 part and a bias."""
    k = 256
    q = _q4k_linear(random_blocks(QT.Q4_K, 8, k, seed=5), 8, k)   # as the GGUF loader re-blocks them
    kk = _q4k_linear(random_blocks(QT.Q4_K, 4, k, seed=6), 4, k)
    v = as_linear(QT.Q6_K, random_blocks(QT.Q6_K, 4, k, seed=7), 4, k)
    f = Linear.dense(torch.randn(3, k) * 0.01)
    v.bias = torch.randn(4)
    w = concat_rows([q, kk, v, f])
    assert w.parts is not None and len(w.parts) == 3   # Q and K share one layout: one part
    dense = torch.cat([p.dequantize() for p in (q, kk, v, f)])
    assert torch.equal(w.dequantize(), dense)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(8))
    ref = x.double() @ dense.double().T + w.bias.double()
    scale = ref.abs().max().item()
    for exact in (True, False):
        got = native_product(w, x, exact)
        want = ref if exact else quantized(x).double() @ dense.double().T + w.bias.double()
        assert torch.allclose(got.double(), want, rtol=0, atol=1e-4 * scale)
    assert torch.allclose(w(x).double(), ref, rtol=0, atol=1e-4 * scale)
    res = torch.randn(2, w.n)
    assert torch.allclose(w(x, out=res.clone(), accumulate=True).double(), ref + res.double(), atol=1e-4 * scale)
    assert w.format_name == "Q4_K+Q6_K+F32"


@pytest.mark.parametrize("qt", [QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.IQ4_NL, QT.IQ4_XS, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [512, 576, 192])   # G % 4 == 0, 2 (the last pair), 2; 256-blocks: 512, 768
def test_reblocked_rows(qt: QT, k: int) -> None:
    """Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS and Q6_K re-blocked at load (qtypes.h's QT_R_*): the same bytes per row, every
    weight bit-exact, the ggml blocks recovered exactly, the exact path's products bit-identical
    to the blocks read in place and the fast path's equal up to fp32 summation order."""
    n = 6
    if k % gguf.GGML_QUANT_SIZES[qt][0]:
        k = 768   # Q5_K, Q6_K, IQ4_XS: whole super-blocks
    blocks = random_blocks(qt, n, k, seed=11)
    w = Linear.from_raw(int(qt), blocks, n, k)
    raw = Linear.from_raw(int(qt), blocks, n, k, reblock=False)
    assert w.reblocked and raw.raw and w.format_name == raw.format_name == qt.name
    assert w.data.shape == raw.data.shape
    ref = gguf.quants.dequantize(blocks, qt).reshape(n, k)
    assert np.array_equal(bits(w.dequantize().numpy()), bits(ref))
    assert np.array_equal(w.ggml_blocks().data.numpy(), blocks)
    qk = gguf.GGML_QUANT_SIZES[qt][0]
    cut = w.block_cols(qk, k)   # a tensor-parallel cut, through the ggml blocks
    assert cut is not None and cut.format_name == qt.name
    assert np.array_equal(bits(cut.dequantize().numpy()), bits(ref[:, qk:]))
    out = np.empty(k, np.float32)
    lib.ss_qt_dequant(w.fmt, w.data[2:].contiguous().data_ptr(), 0, 1, k, out.ctypes.data)   # an embedding row
    assert np.array_equal(bits(out), bits(ref[2]))
    for rows in (1, 3, 9):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(native_product(w, x, exact=True), native_product(raw, x, exact=True))
        fast, want = native_product(w, x, exact=False), native_product(raw, x, exact=False)
        scale = want.abs().max().item()
        assert torch.allclose(fast, want, rtol=0, atol=2e-6 * scale)
        ref_q = quantized(x).double() @ torch.from_numpy(ref).double().T
        assert torch.allclose(fast.double(), ref_q, rtol=0, atol=1e-5 * scale)


def test_reblocking_needs_pairs_of_groups() -> None:
    """K not a multiple of 64 (an odd number of groups) keeps the file's blocks."""
    blocks = random_blocks(QT.Q5_0, 3, 96, seed=12)
    w = Linear.from_raw(int(QT.Q5_0), blocks, 3, 96)
    assert w.raw and not w.reblocked
    x = torch.randn(2, 96)
    ref = x.double() @ w.dequantize().double().T
    assert torch.allclose(w(x).double(), ref, rtol=0, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("qt", [QT(t) for t in RAW_TYPES] + [QT.Q4_0, QT.Q4_1, QT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("k", [512, 576])   # 576: the last groups short of four (blocks of 32 only)
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(qt: QT, exact: bool, k: int) -> None:
    """Every row of a native product comes out bit for bit as it does alone, beside 1 to 11 other rows (the
    kernels take up to 8 rows at a time): the step's batch invariance on the fast path too, for every block
    type a GGUF file may hold (speculative verification, prompt chunks beside decode rows, batch 8 against 1).
    Q6_K failed it until its kernel took one arithmetic for every row count."""
    if k % 256 and int(qt) in RAW_TYPES and RAW_TYPES[int(qt)][1] == 256:
        pytest.skip("a 256-weight block type")
    n = 40
    if qt in (QT.F16, QT.BF16):
        w32 = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
        blocks = w32.to(torch.float16 if qt == QT.F16 else torch.bfloat16).view(torch.uint8).numpy()
    else:
        blocks = random_blocks(qt, n, k, seed=5)
    w = as_linear(qt, blocks, n, k)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([native_product(w, x[i:i + 1], exact) for i in range(12)])
    for rows in range(2, 13):
        got = native_product(w, x[:rows], exact)
        bad = [i for i in range(rows) if not torch.equal(got[i], alone[i])]
        assert not bad, f"{rows} rows: rows {bad} differ from alone"


@pytest.mark.parametrize("qt", [QT.IQ4_NL, QT.IQ4_XS, QT.IQ2_XXS, QT.MXFP4, QT.IQ2_XS, QT.IQ1_M, QT.Q3_K, QT.Q2_K], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [64, 576, 1536])
def test_the_16_row_kernels_give_the_8_row_kernels_bits(qt: QT, k: int) -> None:
    """qtypes.h's qt_rbnl_rows16 and qt_rb16_rows16 (AVX-512 VNNI builds, from amx.h's iq16_from_rows activation rows
    on) against the 8-row kernels, forced by ss_set_iq16_rows: the same bits on 1-12 rows (elsewhere both settings run
    the 8-row kernel)."""
    if k % 256 and RAW_TYPES[int(qt)][1] == 256:
        pytest.skip("a 256-weight block type")
    n = 45
    w = as_linear(qt, random_blocks(qt, n, k, seed=7), n, k)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(8))
    old = lib.ss_set_iq16_rows(0)
    try:
        for rows in (1, 2, 8, 12):
            lib.ss_set_iq16_rows(1)
            wide = native_product(w, x[:rows], exact=False)
            lib.ss_set_iq16_rows(9)
            assert torch.equal(wide, native_product(w, x[:rows], exact=False)), rows
    finally:
        lib.ss_set_iq16_rows(old)
