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


@pytest.mark.parametrize("lengths,H,KVH,D", [([7], 4, 2, 16), ([1, 130, 1500], 9, 3, 64), ([33, 5], 8, 8, 32),
                                                   ([5, 67], 8, 2, 80), ([9, 2], 6, 2, 20), ([3, 66], 4, 1, 256)])
def test_attn_decode(lengths: list[int], H: int, KVH: int, D: int):
    g = torch.Generator().manual_seed(sum(lengths))
    S, total = len(lengths), sum(lengths) + 50
    kc, vc = torch.randn(total, KVH, D, generator=g), torch.randn(total, KVH, D, generator=g)
    perm = torch.randperm(total, generator=g)          # scattered slots, like a paged cache
    seq_slots, start = [], 0
    for n in lengths:
        seq_slots.append(perm[start:start + n].clone())
        start += n
    slots = torch.cat(seq_slots)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    row = (H + 2 * KVH) * D                             # q rows sit inside fused qkv rows
    qkv = torch.randn(S, row, generator=g)
    out = torch.empty(S, H * D)
    scale = D ** -0.5
    lib.attn_decode(qkv.data_ptr(), row, S, H, KVH, D, slots.data_ptr(), starts.data_ptr(),
                    kc.data_ptr(), vc.data_ptr(), f32(scale), out.data_ptr())
    want = ref.attn_decode(qkv[:, :H * D].view(S, H, D), kc, vc, seq_slots, scale)
    torch.testing.assert_close(out.view(S, H, D), want, rtol=1e-4, atol=1e-5)


def test_silu_mul():
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(3, 2 * 96, generator=g) * 4
    out = torch.empty(3, 96)
    lib.silu_mul(gu.data_ptr(), 3, 96, out.data_ptr())
    torch.testing.assert_close(out, ref.silu_mul(gu), rtol=1e-5, atol=1e-6)
