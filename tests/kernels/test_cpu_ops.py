"""Each native CPU operator against its torch reference, on random inputs."""
from __future__ import annotations

import ctypes

import pytest
import torch

from slipstream.kernels.cpu import load_library
from slipstream.kernels.cpu import reference as ref

lib = load_library()
pytestmark = pytest.mark.skipif(lib is None, reason="native CPU kernels unavailable")
f32 = ctypes.c_float


@pytest.mark.parametrize("rows,n", [(1, 64), (3, 576), (8, 100)])
def test_rmsnorm(rows: int, n: int):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, n, generator=g) * 3, torch.randn(n, generator=g)
    out = torch.empty_like(x)
    lib.rmsnorm(x.data_ptr(), w.data_ptr(), rows, n, f32(1e-5), out.data_ptr())
    torch.testing.assert_close(out, ref.rmsnorm(x, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("T,H,KVH,D", [(1, 4, 2, 16), (5, 9, 3, 64), (2, 8, 8, 32)])
def test_rope_store(T: int, H: int, KVH: int, D: int, qk_norm: bool):
    g = torch.Generator().manual_seed(T * 100 + H)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    pos = torch.randint(0, 4000, (T,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = pos.float()[:, None] * inv[None, :]
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    qn, kn = (torch.randn(D, generator=g), torch.randn(D, generator=g)) if qk_norm else (None, None)
    slots = torch.randperm(32, generator=g)[:T]
    kc, vc = torch.zeros(32, KVH, D), torch.zeros(32, KVH, D)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = ref.rope_store(qkv.clone(), H, KVH, D, cos, sin, qn, kn, 1e-6, slots, kc_ref, vc_ref)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    lib.rope_store(qkv.data_ptr(), T, H, KVH, D, cos.data_ptr(), sin.data_ptr(), ptr(qn), ptr(kn),
                   f32(1e-6), slots.data_ptr(), kc.data_ptr(), vc.data_ptr())
    torch.testing.assert_close(qkv[:, :H * D].view(T, H, D), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, kc_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc, vc_ref)


def _paged_case(lengths: list[int], H: int, KVH: int, D: int, g: torch.Generator):
    """A random decode-attention case: K and V caches [slots, KVH, D], each sequence's context at
    scattered slots (like a paged cache), fused qkv rows; -> (kc, vc, seq_slots, slots, starts, qkv, row)."""
    total = sum(lengths) + 50
    kc, vc = torch.randn(total, KVH, D, generator=g), torch.randn(total, KVH, D, generator=g)
    perm = torch.randperm(total, generator=g)
    seq_slots, start = [], 0
    for n in lengths:
        seq_slots.append(perm[start:start + n].clone())
        start += n
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    row = (H + 2 * KVH) * D                             # q rows sit inside fused qkv rows
    qkv = torch.randn(len(lengths), row, generator=g)
    return kc, vc, seq_slots, torch.cat(seq_slots), starts, qkv, row


# head sizes: multiples of 16 (the 512-bit body: 1, 2, 3 or 4 vectors of a 64-dim pass, 128 and 256 in two and
# four) and of 8 or 4 only (the 256-bit body even on AVX-512 machines, the scalar loop); query heads per KV head
# 1 to 7 (the 512-bit body takes scores three heads at a time and values four: 2 = 2 | 2, 5 = 3 + 2 | 4 + 1);
# contexts of whole blocks of 8 and ones that leave 1 to 7 keys past them; 8 query heads per KV head at D = 128
# (a common GQA shape); scores soft-capped (cap > 0, Gemma 2's cap * tanh(s / cap)) on the 512-bit body
# (D 64 and 256) and on the 256-bit one (D 40); a cap of 2 changes the N(0, 1) scores' softmax well past tolerance
ATTN_CASES = [([7], 4, 2, 16, 0.0), ([1, 130, 1500], 9, 3, 64, 0.0), ([33, 5], 8, 8, 32, 0.0),
              ([5, 67], 8, 2, 80, 0.0), ([9, 2], 6, 2, 20, 0.0), ([3, 66], 4, 1, 256, 0.0),
              ([13, 301], 14, 2, 48, 0.0), ([9, 42], 12, 2, 96, 0.0), ([64, 17], 4, 2, 128, 0.0),
              ([8, 40], 10, 2, 64, 0.0), ([24, 3], 6, 2, 24, 0.0), ([19, 72], 8, 4, 40, 0.0), ([50], 6, 2, 72, 0.0),
              ([37, 131], 16, 2, 128, 0.0), ([11, 70], 8, 2, 64, 2.0), ([5, 44], 6, 2, 256, 2.0),
              ([21, 9], 8, 4, 40, 2.0)]


@pytest.mark.parametrize("lengths,H,KVH,D,cap", ATTN_CASES)
def test_attn_decode(lengths: list[int], H: int, KVH: int, D: int, cap: float):
    S = len(lengths)
    kc, vc, seq_slots, slots, starts, qkv, row = _paged_case(lengths, H, KVH, D,
                                                             torch.Generator().manual_seed(sum(lengths)))
    out = torch.empty(S, H * D)
    scale = D ** -0.5
    lib.attn_decode(qkv.data_ptr(), row, S, H, KVH, D, slots.data_ptr(), starts.data_ptr(),
                    kc.data_ptr(), vc.data_ptr(), f32(scale), f32(cap), out.data_ptr())
    want = ref.attn_decode(qkv[:, :H * D].view(S, H, D), kc, vc, seq_slots, scale, cap)
    torch.testing.assert_close(out.view(S, H, D), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lengths,H,KVH,D,cap", ATTN_CASES + [([200], 9, 3, 64, 0.0)])
def test_attn_decode_f16(lengths: list[int], H: int, KVH: int, D: int, cap: float):
    """Attention over an fp16 cache (the fast path's default): the keys and values widened in registers
    give the reference's result over the same fp16 values to fp32 rounding (rtol 1e-4, atol 1e-5), and
    the fp32-cache result to within the cache's rounding (half precision: 2^-11 relative per element;
    the outputs here, weighted means of N(0, 1) values, within 2e-3)."""
    S = len(lengths)
    kc, vc, seq_slots, slots, starts, qkv, row = _paged_case(lengths, H, KVH, D,
                                                             torch.Generator().manual_seed(sum(lengths) + D))
    kh, vh = kc.half(), vc.half()
    out = torch.empty(S, H * D)
    scale = D ** -0.5
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.attn_decode_f16(vp(qkv.data_ptr()), i32(row), i32(S), i32(H), i32(KVH), i32(D), vp(slots.data_ptr()),
                        vp(starts.data_ptr()), vp(kh.data_ptr()), vp(vh.data_ptr()), f32(scale), f32(cap),
                        vp(out.data_ptr()))
    q = qkv[:, :H * D].view(S, H, D)
    torch.testing.assert_close(out.view(S, H, D), ref.attn_decode(q, kh.float(), vh.float(), seq_slots, scale, cap),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.view(S, H, D), ref.attn_decode(q, kc, vc, seq_slots, scale, cap),
                               rtol=0, atol=2e-3)


@pytest.mark.parametrize("lengths,H,KVH,D,cap", ATTN_CASES + [([200], 9, 3, 64, 0.0)])
def test_attn_decode_i8(lengths: list[int], H: int, KVH: int, D: int, cap: float):
    """Attention over an int8 cache (--kv-cache-dtype int8): codes widened in registers, each score scaled by
    its key row's scale and each value weight by its value row's, gives the reference's result over the
    dequantized values (codes x scales) to fp32 rounding, and the fp32-cache result to within the codes'
    rounding (half a step of absmax / 127 per element, absmax ~3 for these N(0, 1) rows of up to 256: the outputs
    within 4e-2; measured 2.7e-2 at D = 256)."""
    from slipstream.kv.blocks import int8_rows

    S = len(lengths)
    kc, vc, seq_slots, slots, starts, qkv, row = _paged_case(lengths, H, KVH, D,
                                                             torch.Generator().manual_seed(sum(lengths) + 7 * D))
    (kq, ks), (vq, vs) = int8_rows(kc), int8_rows(vc)
    out = torch.empty(S, H * D)
    scale = D ** -0.5
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.attn_decode_i8(vp(qkv.data_ptr()), i32(row), i32(S), i32(H), i32(KVH), i32(D), vp(slots.data_ptr()),
                       vp(starts.data_ptr()), vp(kq.data_ptr()), vp(vq.data_ptr()), vp(ks.data_ptr()),
                       vp(vs.data_ptr()), f32(scale), f32(cap), vp(out.data_ptr()))
    q = qkv[:, :H * D].view(S, H, D)
    kd, vd = kq.float() * ks[..., None], vq.float() * vs[..., None]
    torch.testing.assert_close(out.view(S, H, D), ref.attn_decode(q, kd, vd, seq_slots, scale, cap),
                               rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(out.view(S, H, D), ref.attn_decode(q, kc, vc, seq_slots, scale, cap),
                               rtol=0, atol=4e-2)


def test_f32_to_i8_rows_as_torch():
    """The int8 cache's store: the same codes and scales as kv/blocks.py's int8_rows (round half to even
    of x / (absmax / 127)), over random rows, rows with exact ties, a row of zeros and rows of one value."""
    from slipstream.kv.blocks import int8_rows

    g = torch.Generator().manual_seed(5)
    D = 64
    ties = (torch.arange(D) - 32).float() * 0.5 * (127 / 64)   # absmax 63.5 x ... : steps of half a code
    x = torch.cat([torch.randn(300, D, generator=g) * 3, torch.randn(20, D, generator=g) * 1e-30,
                   ties[None], torch.zeros(1, D), torch.full((1, D), -2.5), torch.full((1, D), 7.0)]).contiguous()
    codes, scales = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[0])
    lib.f32_to_i8_rows(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_int(D),
                       ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(scales.data_ptr()))
    want_codes, want_scales = int8_rows(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes)
    assert codes.abs().max().item() == 127 and torch.equal(codes[-3], torch.zeros(D, dtype=torch.int8))


def test_f32_to_f16_rounds_as_torch():
    """The cache store's conversion: bit-identical to torch's .half() (nearest, ties to even), over normal,
    subnormal, overflowing and tie values, on the vector path and the scalar tail."""
    g = torch.Generator().manual_seed(3)
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    finite = halves[torch.isfinite(halves)]
    ties = (finite[:-1] + finite[1:]) / 2                # exactly between two halves (where representable)
    x = torch.cat([torch.randn(10001, generator=g) * 10, torch.randn(1000, generator=g) * 1e-6,
                   torch.tensor([65504.0, 65519.0, 65520.0, 1e6, -1e6, float("inf"), -float("inf"), 0.0, -0.0,
                                 2.0 ** -25, 2.0 ** -24, 3 * 2.0 ** -26, 1e-30]), finite, ties]).contiguous()
    out = torch.empty(x.numel(), dtype=torch.float16)
    lib.f32_to_f16(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.numel()), ctypes.c_void_p(out.data_ptr()))
    assert torch.equal(out.view(torch.int16), x.half().view(torch.int16))
    tail = x[:7].contiguous()                             # fewer than a vector: the portable converter
    out7 = torch.empty(7, dtype=torch.float16)
    lib.f32_to_f16(ctypes.c_void_p(tail.data_ptr()), ctypes.c_int64(7), ctypes.c_void_p(out7.data_ptr()))
    assert torch.equal(out7.view(torch.int16), tail.half().view(torch.int16))


def test_silu_mul():
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(3, 2 * 96, generator=g) * 4
    out = torch.empty(3, 96)
    lib.silu_mul(gu.data_ptr(), 3, 96, out.data_ptr())
    torch.testing.assert_close(out, ref.silu_mul(gu), rtol=1e-5, atol=1e-6)
