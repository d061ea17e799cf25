"""The SIMD row kernels (kernels/cpu/simd.h) against their torch references, on whichever
instruction set this library was built for (test_isa_builds.py reruns this file for the others)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from slipstream.kernels.cpu import load_library
from slipstream.kernels.cpu import reference as ref
from slipstream.weights.quant import Q4_0, Q4_1, Q4_F32, Q8_0, Linear, concat_rows

lib = load_library()
pytestmark = pytest.mark.skipif(lib is None, reason="native CPU kernels unavailable")


def _random_packed(fmt: int, n: int, k: int, seed: int) -> Linear:
    """A packed matrix with random codes and scales (every code value, both signs of scale)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // 32
    scale = torch.randn(n, groups, generator=g) * 0.05
    if fmt == Q8_0:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int64).to(torch.int8)
        return Linear(n, k, q, fmt, scale.contiguous())
    codes = torch.randint(0, 16, (n, groups, 32), generator=g, dtype=torch.int64)
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8).reshape(n, k // 2)
    mn = torch.randn(n, groups, generator=g) * 0.1 if fmt != Q4_0 else -8 * scale
    return Linear(n, k, packed.contiguous(), fmt, scale.contiguous(), mn.contiguous())


def _parts(w: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if w.fmt == Q8_0:
        return w.data.to(torch.float32), w.scale, None
    p = w.data.view(w.n, w.k // 32, 16)
    codes = torch.cat([p & 15, p >> 4], dim=-1).to(torch.float32).reshape(w.n, w.k)
    return codes, w.scale, w.min


def _matmul(w: Linear, x: torch.Tensor, exact: bool) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.n)
    m = w.ss_mat()
    lib.ss_matmul(ctypes.byref(m), x.shape[0], x.contiguous().data_ptr(), y.data_ptr(), int(exact))
    return y


def test_isa_is_vectorised_where_the_cpu_has_vectors():
    isa = lib.ss_isa().decode()
    flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    march = __import__("os").environ.get("SLIPSTREAM_MARCH", "native")
    if march == "native" and " avx2 " in flags and " fma " in flags:
        assert isa.startswith("avx"), isa


@pytest.mark.parametrize("rows,k", [(1, 32), (3, 576), (8, 1536), (2, 96)])
def test_quantize_matches_reference(rows: int, k: int):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=g) * 4
    x[0, :32] = 0    # an all-zero group: d = 0, codes 0
    x[-1, 5] = 1e-30
    q, d, s = torch.empty(rows, k, dtype=torch.int8), torch.empty(rows, k // 32), torch.empty(rows, k // 32)
    lib.ss_quantize(x.data_ptr(), rows, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    rq, rd, rs = ref.quantize_q8(x)
    assert torch.equal(q, rq)
    assert torch.equal(d, rd)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", [Q4_0, Q4_1, Q4_F32, Q8_0])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_fast_product_matches_reference(fmt: int, rows: int):
    w = _random_packed(fmt, 40, 320, seed=fmt * 10 + rows)
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows)) * 2
    got = _matmul(w, x, exact=False)
    want = ref.product_q8(_parts(w), x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", [Q4_0, Q4_1, Q4_F32, Q8_0, None])
@pytest.mark.parametrize("rows", [1, 5, 8, 9])
def test_exact_product_matches_dequantized_matmul(fmt: int | None, rows: int):
    w = _random_packed(fmt, 24, 256, seed=rows) if fmt is not None else \
        Linear.dense(torch.randn(24, 200, generator=torch.Generator().manual_seed(rows)))
    x = torch.randn(rows, w.k, generator=torch.Generator().manual_seed(100 + rows))
    got = _matmul(w, x, exact=True)
    want = (x.double() @ w.dequantize().double().T).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_fast_product_error_is_small_against_exact():
    """Quantizing activations to 8 bits costs well under 1% of the product's size."""
    w = concat_rows([_random_packed(Q4_1, 64, 576, seed=1), _random_packed(Q4_1, 64, 576, seed=2)])
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(3))
    exact, fast = _matmul(w, x, exact=True), _matmul(w, x, exact=False)
    assert ((fast - exact).norm() / exact.norm()).item() < 0.01



@pytest.mark.parametrize("fmt", [Q4_1, Q8_0])
@pytest.mark.parametrize("exact", [False, True])
def test_zero_rows_touch_nothing(fmt: int, exact: bool):
    """An empty batch (a prefill chunk of no tokens, x's pointer NULL) computes nothing and reads nothing:
    the row loops dispatch on the row count, where 0 must not fall through to the 8-row body."""
    w = _random_packed(fmt, 64, 96, seed=5)
    m = w.ss_mat()
    y = torch.full((1, 64), 7.0)
    lib.ss_matmul(ctypes.byref(m), 0, None, y.data_ptr(), int(exact))
    assert torch.equal(y, torch.full((1, 64), 7.0))


def _amx(on: bool) -> bool:
    return bool(lib.ss_set_amx(int(on)))


TWIN = lib is not None and lib.ss_tile_planes() == 1   # an AVX-512 VNNI build: the twin (and tiles where AMX is)


def _cpu_info() -> dict[str, str]:
    """The first CPU's fields of /proc/cpuinfo (vendor_id, cpu family, flags, ...)."""
    first = open("/proc/cpuinfo").read().split("\n\n")[0]
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}


@pytest.mark.skipif(not TWIN, reason="no 512-bit VNNI in this build")
def test_rows8_default_comes_from_the_build_and_the_cpu():
    """Which kinds take the 8-row kernels by default: all six on AVX-512 VNNI builds, except Q5_K (bit 3) and
    Q5_0/Q5_1 (bit 4) on Zen 4 (AMD family 25), whose 8-row kernels cost 4-10% at batch 1 there; SLIPSTREAM_ROWS8
    sets the mask."""
    if "SLIPSTREAM_ROWS8" in os.environ:
        pytest.skip("SLIPSTREAM_ROWS8 sets the mask here")
    info = _cpu_info()
    zen4 = info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
    assert lib.ss_rows8() == (63 & ~(8 | 16) if zen4 else 63)


@pytest.mark.skipif(not TWIN or not _amx(True), reason="no AMX tiles on this CPU, build or kernel")
@pytest.mark.parametrize("fmt", [Q4_0, Q4_1, Q4_F32, Q8_0])
@pytest.mark.parametrize("rows,k", [(2, 352), (4, 64), (8, 352), (8, 1536), (13, 96), (8, 448), (8, 576), (6, 416)])
def test_amx_tiles_agree_with_the_vector_kernels(fmt: int, rows: int, k: int):
    """The batched fast products on AMX tiles (kernels/cpu/amx.h) against their vector twin (bitwise: the
    same int32 group sums, the same fp32 sequence), the AVX2 builds' kernels (twin off; fp32 rounding apart)
    and the reference. 88 weight rows are five tiles of 16 and 8 rows left to the twin; K of 64, 96, 352 and
    1536 give fewer groups than the tiles keep in flight, partial blocks of four groups and long rows; the
    pair loop runs four pairs at a time and then 0-3 more (K = 1536: 24 pairs, 576: 9, 352: 6, 448: 7, and 416:
    13 groups, the last pair's second group empty)."""
    w = _random_packed(fmt, 88, k, seed=fmt + rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k)) * 2
    try:
        tiles = _matmul(w, x, exact=False)
        _amx(False)
        twin = _matmul(w, x, exact=False)
        lib.ss_set_twin(0)
        paired = _matmul(w, x, exact=False)
    finally:
        lib.ss_set_twin(1)
        _amx(True)
    scale = paired.abs().max().item()
    assert torch.equal(tiles, twin)
    torch.testing.assert_close(tiles, paired, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(tiles, ref.product_q8(_parts(w), x), rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.skipif(not TWIN, reason="no 512-bit VNNI in this build (the twin's instructions)")
@pytest.mark.parametrize("fmt", [Q4_0, Q4_1, Q4_F32, Q8_0])
@pytest.mark.parametrize("k", [64, 352, 1536])
def test_amx_rows_are_the_same_alone_and_batched(fmt: int, k: int):
    """On AVX-512 VNNI machines a row's fast-path product is bitwise the same whatever shares its step: 8
    rows go on AMX tiles where the CPU has them, a row alone (and the 5 weight rows past the last block of
    16) on their vector twin, which follows the tiles' arithmetic exactly (kernels/cpu/amx.h); without AMX
    every row runs on the twin. Speculative verification and prompt chunks beside decode rows rely on it."""
    w = _random_packed(fmt, 85, k, seed=fmt + k)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(k)) * 2
    together = _matmul(w, x, exact=False)
    for i in range(8):
        assert torch.equal(_matmul(w, x[i:i + 1], exact=False)[0], together[i]), i
    assert torch.equal(_matmul(w, x[:3], exact=False), together[:3])
    m = w.ss_mat()   # without the tile-ordered copy of the scales (gathered from the [N][G] planes): the same bits
    m.scale_t = m.min_t = None
    for rows in (1, 8):
        y = torch.empty(rows, w.n)
        lib.ss_matmul(ctypes.byref(m), rows, x[:rows].contiguous().data_ptr(), y.data_ptr(), 0)
        assert torch.equal(y, together[:rows]), rows
    torch.testing.assert_close(together, ref.product_q8(_parts(w), x), rtol=1e-4,
                               atol=1e-4 * together.abs().max().item())


@pytest.mark.skipif(not TWIN, reason="no 512-bit VNNI in this build (the twin's instructions)")
@pytest.mark.parametrize("fmt", [Q4_0, Q4_1, Q4_F32, Q8_0])
@pytest.mark.parametrize("k", [32, 160, 576])
def test_rows8_kernels_follow_the_twin_bitwise(fmt: int, k: int):
    """On AVX-512 VNNI builds the rows the tiles do not take go to the 8-row kernels (simd.h q4i_rows8,
    q8i_rows8) in the tiles' arithmetic (even and odd groups in two sums): bitwise what the twin kernels give
    (ss_set_rows8(0)), for 1 to 8 rows, fp32 and fp16 scales, a bias, 45 weight rows (a block of 16 off its
    end) and blocks that start off a multiple of 8 (11 rows: chunks of 8 against blocks of weight rows). So the
    row count from which the twin takes over on CPUs with wide 512-bit vpdpbusd (ss_set_twin_rows) changes
    no result: forced to 9 (never) for the 8-row kernels, to 1 (always) with them on; nor does the twin's kind
    (lanes = weight rows from the start, twin16_rows_*, or partial sums reduced across lanes, ss_set_twin16(0))."""
    base = _random_packed(fmt, 45, k, seed=fmt + 5 * k)
    bias = torch.randn(45, generator=torch.Generator().manual_seed(k))
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(k + 2)) * 2
    for half in (False, True):
        sc = base.scale.half() if half else base.scale
        mn = None if base.min is None or (half and fmt == Q4_0) else base.min.to(sc.dtype)
        w = Linear(base.n, k, base.data, fmt, sc.contiguous(), None if mn is None else mn.contiguous(), bias)
        before, from_rows, kind = lib.ss_rows8(), lib.ss_set_twin_rows(0), lib.ss_set_twin16(-1)
        try:
            for rows in (1, 2, 5, 8, 11):
                assert lib.ss_set_rows8(15) == 15 and lib.ss_set_twin_rows(9) == 9
                rows8 = _matmul(w, x[:rows], exact=False)
                lib.ss_set_twin_rows(1)
                by_threshold = _matmul(w, x[:rows], exact=False)
                lib.ss_set_rows8(0)
                twin = _matmul(w, x[:rows], exact=False)
                assert lib.ss_set_twin16(0) == 0
                reducing = _matmul(w, x[:rows], exact=False)
                lib.ss_set_twin16(1)
                assert torch.equal(rows8, twin) and torch.equal(by_threshold, twin), (half, rows)
                assert torch.equal(reducing, twin), (half, rows)
        finally:
            lib.ss_set_rows8(before)
            lib.ss_set_twin_rows(from_rows)
            lib.ss_set_twin16(kind)


@pytest.mark.skipif(not TWIN, reason="no 512-bit VNNI in this build (the twin's instructions)")
def test_twin_rows_come_from_the_cpu_or_the_environment():
    """The row count from which the 512-bit twin takes the q4/q8 products comes from the CPU (2 on AMD family 26,
    Zen 5, and later, whose 512-bit vpdpbusd runs at the 256-bit one's instruction rate, and on family 25 with
    AVX-512, Zen 4, where twin16 still wins from 2 rows; else 9, never, where AMX tiles take the batches: a build
    with them whose kernel grants the tile state; 6 elsewhere) unless SLIPSTREAM_TWIN_ROWS sets it; the IQ types' 16-row kernels take 2 rows on unless SLIPSTREAM_IQ16_ROWS says."""
    import subprocess
    import sys
    info = _cpu_info()
    amd = int(info.get("cpu family", "0")) if info.get("vendor_id") == "AuthenticAMD" else 0
    wide = amd >= 26
    if "SLIPSTREAM_TWIN_ROWS" not in os.environ:
        flags = set(info.get("flags", "").split())
        tiles = {"amx_tile", "amx_int8"} <= flags and not os.environ.get("SLIPSTREAM_MARCH")
        assert lib.ss_set_twin_rows(0) == (2 if wide or amd == 25 else 9 if tiles and lib.ss_amx_active() else 6)
    if "SLIPSTREAM_IQ16_ROWS" not in os.environ:
        assert lib.ss_set_iq16_rows(0) == 2
    lib_ = "from slipstream.kernels.cpu import load_library; lib = load_library(); "
    code = lib_ + "print(lib.ss_set_twin_rows(0), lib.ss_set_iq16_rows(0))"
    env = {**os.environ, "SLIPSTREAM_TWIN_ROWS": "5", "SLIPSTREAM_IQ16_ROWS": "7"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["5", "7"]
    if tiles and not wide and "SLIPSTREAM_TWIN_ROWS" not in os.environ:
        # a kernel that refuses the tile state (here: SLIPSTREAM_AMX=0) leaves a build without tiles: 6
        env = {**os.environ, "SLIPSTREAM_AMX": "0"}
        out = subprocess.run([sys.executable, "-c", lib_ + "print(lib.ss_set_twin_rows(0), lib.ss_amx_active())"],
                             env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["6", "0"]


@pytest.mark.skipif(not TWIN or not _amx(True), reason="no AMX tiles on this CPU, build or kernel")
@pytest.mark.parametrize("fmt", [Q4_0, Q4_1, Q4_F32, Q8_0])
@pytest.mark.parametrize("k", [32, 160, 608])
def test_amx_odd_group_counts_with_bias(fmt: int, k: int):
    """The tiles multiply groups in pairs (kernels/cpu/amx.h): an odd group count leaves the last pair one
    group and a zero one (K = 32: a single group). At 6 and 7 rows (the fewest q4 tiles take), fp32 and fp16
    scales, with a bias and 40 weight rows (two tiles and 8 rows on the twin): bitwise the twin's, and a row's
    result alone, and close to the reference."""
    base = _random_packed(fmt, 40, k, seed=fmt + k)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(k))
    for half in (False, True):
        sc = base.scale.half() if half else base.scale
        mn = None if base.min is None or (half and fmt == Q4_0) else base.min.to(sc.dtype)
        w = Linear(base.n, k, base.data, fmt, sc.contiguous(), None if mn is None else mn.contiguous(), bias)
        for rows in (6, 7):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k)) * 2
            x[0, -32:] = 0   # the last group all zero (d = 0)
            try:
                tiles = _matmul(w, x, exact=False)
                _amx(False)
                twin = _matmul(w, x, exact=False)
            finally:
                _amx(True)
            assert torch.equal(tiles, twin), (half, rows)
            assert torch.equal(_matmul(w, x[rows - 1:], exact=False)[0], tiles[-1]), (half, rows)
            sc32, mn32 = w.scale.float(), None if w.min is None else w.min.float()
            want = ref.product_q8((_parts(w)[0], sc32, mn32 if fmt != Q4_0 else -8 * sc32), x) + bias
            torch.testing.assert_close(tiles, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


ROWS8 = lib is not None and lib.ss_tile_planes() == 2   # an AVX2 build: q4 products 8 weight rows at a time


@pytest.mark.skipif(not ROWS8, reason="not an AVX2 build (the 8-row kernels, simd.h q4i_rows8 and q8i_rows8)")
@pytest.mark.parametrize("fmt", [Q4_0, Q4_1, Q4_F32, Q8_0])
@pytest.mark.parametrize("k", [32, 160, 576])
def test_rows8_are_the_same_alone_and_batched(fmt: int, k: int):
    """The AVX2 fast q4 and q8 products take 8 weight rows at a time for every activation row count (one
    arithmetic; q8 reaches its exact group sums another way at one row): a row's result is bitwise the same
    alone, beside 7 others and in a prompt-sized batch (11 rows: chunks of 8 against blocks of weight rows
    that start off a multiple of 8, whose scales are gathered rather than read from the tile-ordered copy),
    with fp32 and fp16 scales, a bias and 45 weight rows (a last block of 5); and it is close to the
    reference product."""
    base = _random_packed(fmt, 45, k, seed=fmt + 3 * k)
    bias = torch.randn(45, generator=torch.Generator().manual_seed(k))
    for half in (False, True):
        sc = base.scale.half() if half else base.scale
        mn = None if base.min is None or (half and fmt == Q4_0) else base.min.to(sc.dtype)
        w = Linear(base.n, k, base.data, fmt, sc.contiguous(), None if mn is None else mn.contiguous(), bias)
        x = torch.randn(11, k, generator=torch.Generator().manual_seed(k + 1)) * 2
        x[1, -32:] = 0   # a last group all zero (d = 0)
        together = _matmul(w, x[:8], exact=False)
        for i in range(8):
            assert torch.equal(_matmul(w, x[i:i + 1], exact=False)[0], together[i]), (half, i)
        assert torch.equal(_matmul(w, x[:3], exact=False), together[:3]), half
        assert torch.equal(_matmul(w, x, exact=False)[:8], together), half
        m = w.ss_mat()   # without the tile-ordered copy (scales gathered from the [N][G] planes): the same bits
        assert m.scale_t
        m.scale_t = m.min_t = None
        y = torch.empty(8, w.n)
        lib.ss_matmul(ctypes.byref(m), 8, x[:8].contiguous().data_ptr(), y.data_ptr(), 0)
        assert torch.equal(y, together), half
        sc32 = w.scale.float()
        mn32 = None if fmt == Q8_0 else -8 * sc32 if w.min is None else w.min.float()
        want = ref.product_q8((_parts(w)[0], sc32, mn32), x[:8]) + bias
        torch.testing.assert_close(together, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


QT_ROWS8 = lib is not None and lib.ss_tile_planes() > 0   # x86 builds with AVX2: Q6_K, Q5 8 rows at a time
# ggml type -> (its ss_set_rows8 bit, shapes): Q5_0 and Q5_1 by default on AVX-512 builds only (bit 4), IQ4_NL and
# IQ4_XS bit 5; K = 576 leaves a last pair of groups after the fours (G % 4 == 2), K = 64 nothing but that pair
QT_ROWS8_CASES = {14: (4, [(45, 256), (19, 768), (19, 2816)]), 13: (8, [(45, 256), (21, 768)]),
                  6: (16, [(45, 576), (37, 256), (20, 64)]), 7: (16, [(45, 576), (19, 1536)]),
                  20: (32, [(45, 576), (37, 256), (20, 64)]), 23: (32, [(45, 256), (19, 1536)])}


@pytest.mark.skipif(not QT_ROWS8, reason="no 8-row Q6_K and Q5 kernels in this build (x86 with AVX2 only)")
@pytest.mark.parametrize("qtype", list(QT_ROWS8_CASES))
def test_qtype_rows8_alone_batched_and_against_the_one_row_kernels(qtype: int):
    """Q6_K, Q5_K, Q5_0, Q5_1, IQ4_NL and IQ4_XS rows, re-blocked at load, on 8 weight rows at a time (qtypes.h
    qt_rb6_rows8, qt_rb5_rows8, qt_rbnl_rows8) for every activation row count: a row's result is bitwise the same alone, beside 7
    others and in an 11-row batch (a chunk of 8 and one of 3), over a last block of 3 to 5 weight rows; it is what
    the one-row kernels give (ss_set_rows8 without the type's bit) up to the fp32 order of the group sums, and close
    to the exact path."""
    from support import random_blocks
    bit, shapes = QT_ROWS8_CASES[qtype]
    before = lib.ss_rows8()
    try:
        for n, k in shapes:
            w = Linear.from_raw(qtype, random_blocks(qtype, n, k, seed=n, size=2.0 / k ** 0.5), n, k)
            x = torch.randn(11, k, generator=torch.Generator().manual_seed(k)) * 2
            x[2] = 0   # an all-zero row (d = 0)
            x[1, -32:] = 0
            assert lib.ss_set_rows8(15 | bit) & bit
            together = _matmul(w, x[:8], exact=False)
            for i in range(8):
                assert torch.equal(_matmul(w, x[i:i + 1], exact=False)[0], together[i]), (n, k, i)
            assert torch.equal(_matmul(w, x, exact=False)[:8], together), (n, k)
            assert torch.equal(together[2], torch.zeros(n))
            lib.ss_set_rows8(15 & ~bit)
            one_row = _matmul(w, x[:8], exact=False)
            assert not torch.equal(one_row, together), (n, k)   # the switch did something: another fp32 order
            torch.testing.assert_close(together, one_row, rtol=1e-5, atol=1e-5 * one_row.abs().max().item())
            exact = _matmul(w, x[:8], exact=True)
            assert ((together - exact).norm() / exact.norm()).item() < 0.02, (n, k)
    finally:
        lib.ss_set_rows8(before)


@pytest.mark.skipif(not (ROWS8 or TWIN), reason="no 8-row kernels in this build (x86 with AVX2 only)")
def test_rows8_env_switch_puts_the_one_row_kernels_back(tmp_path):
    """SLIPSTREAM_ROWS8=0 at load gives what ss_set_rows8(0) gives in process (the one-row kernels: another
    fp32 order on AVX2 builds, the twin on AVX-512 VNNI ones), a product the user can compare against."""
    w = _random_packed(Q4_1, 40, 160, seed=9)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(9))
    torch.save({"data": w.data, "scale": w.scale, "min": w.min, "x": x}, tmp_path / "case.pt")
    script = (
        "import ctypes, sys, torch\n"
        "from slipstream.kernels.cpu import load_library\n"
        "from slipstream.weights.quant import Q4_1, Linear\n"
        f"c = torch.load({str(tmp_path / 'case.pt')!r})\n"
        "w = Linear(40, 160, c['data'], Q4_1, c['scale'], c['min'])\n"
        "y = torch.empty(3, 40); m = w.ss_mat()\n"
        "load_library().ss_matmul(ctypes.byref(m), 3, c['x'].contiguous().data_ptr(), y.data_ptr(), 0)\n"
        f"torch.save(y, {str(tmp_path / 'y.pt')!r})\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "SLIPSTREAM_ROWS8": "0"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from_env = torch.load(tmp_path / "y.pt")
    before = lib.ss_rows8()
    try:
        lib.ss_set_rows8(0)
        one_row = _matmul(w, x, exact=False)
    finally:
        lib.ss_set_rows8(before)
    assert torch.equal(from_env, one_row)
    if ROWS8:   # on AVX2 builds the default is another arithmetic: the switch did something
        assert not torch.equal(from_env, _matmul(w, x, exact=False))
