"""Triton decode kernels vs their torch references, on CPU under Triton's interpreter.

Small random shapes. Tolerances: float32 paths 1e-4 (abs and rel) except where noted; bf16 paths
compare to a float32 reference of the same bf16 inputs at 2e-2. On a GPU the same tests run
compiled (TRITON_INTERPRET is only set when CUDA is absent)."""
import pytest
import torch

triton = pytest.importorskip("triton")

from slipstream.kernels.triton import attention, matvec, rope, sample  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F32 = dict(atol=1e-4, rtol=1e-4)
BF16 = dict(atol=2e-2, rtol=2e-2)
# quantized weights on the tensor-core path (2-16 rows): activations and dequantized weights as bf16 hi + lo
# parts, about 16 mantissa bits (a wrong scale or group is off by O(1))
SPLIT16 = dict(atol=1e-2, rtol=1e-3)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def rand(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


@pytest.mark.parametrize("qk_norm,padded", [(False, False), (True, False), (False, True)])
def test_rope_kv_append(qk_norm, padded):
    g = gen(3)
    B, H, KVH, D, slots_n = 3, 4, 2, 16, 64
    qkv = rand(B, (H + 2 * KVH) * D, g=g)
    positions = torch.tensor([0, 7, 300], device=DEV)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(DEV)
    # slot -1: a padded row of a CUDA-graph batch bucket, which must leave the cache untouched
    slots = torch.tensor([5, -1, 42] if padded else [5, 17, 42], device=DEV)
    qn = rand(D, g=g) if qk_norm else None
    kn = rand(D, g=g) if qk_norm else None
    kc = rand(slots_n, KVH, D, g=g)
    vc = rand(slots_n, KVH, D, g=g)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = rope.rope_kv_append_ref(qkv, positions, inv_freq, slots, kc_ref, vc_ref, H, KVH, D, qn, kn)
    q = rope.rope_kv_append(qkv, positions, inv_freq, slots, kc, vc, H, KVH, D, q_norm=qn, k_norm=kn)
    tol = dict(atol=2e-4, rtol=2e-4)               # cos/sin of position 300 rad in float32
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(kc, kc_ref, **tol)  # untouched slots must stay equal too
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0)


def test_rope_matches_llama_rope():
    """The reference is the eager model's `_rope` (half-rotation layout)."""
    from slipstream.models.llama import LlamaModel
    g = gen(4)
    B, H, D = 2, 2, 8
    x = rand(B, H, D, g=g)
    positions = torch.tensor([3, 11], device=DEV)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(DEV)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    want = LlamaModel._rope(x, emb.cos()[:, None, :], emb.sin()[:, None, :])
    qkv = torch.cat([x.reshape(B, -1), torch.zeros(B, 2 * D, device=DEV)], dim=1)  # 1 kv head
    kc, vc = torch.zeros(4, 1, D, device=DEV), torch.zeros(4, 1, D, device=DEV)
    got = rope.rope_kv_append(qkv, positions, inv_freq, torch.tensor([0, 1], device=DEV), kc, vc,
                              H, 1, D)
    torch.testing.assert_close(got, want, **F32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention(dtype):
    g = gen(5)
    B, H, KVH, D, bs, num_blocks, max_blocks = 3, 8, 2, 16, 16, 24, 8
    ctx = torch.tensor([1, 37, 128], dtype=torch.int32)     # a single token, a partial block, full
    perm = torch.randperm(num_blocks, generator=g)            # scattered, non-consecutive blocks
    bt = perm[:B * max_blocks].view(B, max_blocks).to(torch.int32)
    q = rand(B, H, D, g=g, dtype=dtype)
    kc = rand(num_blocks * bs, KVH, D, g=g, dtype=dtype)
    vc = rand(num_blocks * bs, KVH, D, g=g, dtype=dtype)
    want = attention.paged_decode_attention_ref(q, kc, vc, bt, ctx)
    # partition 32 -> 4 splits at max context 128: exercises the split-K reduction and empty splits
    got = attention.paged_decode_attention(q, kc, vc, bt.to(DEV), ctx.to(DEV), max_context=128,
                                           partition=32, block_n=16)
    tol = F32 if dtype == torch.float32 else BF16
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # one split only (no reduction across partitions) must agree too
    got1 = attention.paged_decode_attention(q, kc, vc, bt.to(DEV), ctx.to(DEV), max_context=128,
                                            partition=128, block_n=32)
    torch.testing.assert_close(got1.float(), want.float(), **tol)
    # 32 splits: the merge walks them in chunks of 16 (a long context never sits in registers whole)
    got32 = attention.paged_decode_attention(q, kc, vc, bt.to(DEV), ctx.to(DEV), max_context=128,
                                             partition=4, block_n=4)
    torch.testing.assert_close(got32.float(), want.float(), **tol)


def _q8(N, K, g, per_row=False):
    data = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, 1 if per_row else K // 32, generator=g) * 0.02
    return data, scale


def _q4(N, K, g):
    data = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    scale = torch.rand(N, K // 32, generator=g) * 0.02
    mn = -8 * scale + torch.randn(N, K // 32, generator=g) * 0.01
    return data, scale, mn


def test_q4_layout_matches_quant_linear():
    """Our int4 reference decodes the same as `Linear.dequantize` (GGUF-compatible layout)."""
    from slipstream.weights import quant
    g = gen(6)
    N, K = 4, 64
    data, scale, mn = _q4(N, K, g)
    lin = quant.Linear(N, K, data, quant.Q4_F32, scale, mn, None)
    torch.testing.assert_close(matvec.dequantize_ref(data, scale, mn), lin.dequantize(), atol=0, rtol=0)
    d8, s8 = _q8(N, K, g)
    lin8 = quant.Linear(N, K, d8, quant.Q8_0, s8, None, None)
    torch.testing.assert_close(matvec.dequantize_ref(d8, s8), lin8.dequantize(), atol=0, rtol=0)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8_group", "int8_row", "int4", "int4_bf16x"])
@pytest.mark.parametrize("M,split_k", [(1, 1), (3, 1), (8, 3)])
def test_matvec(fmt, M, split_k):
    """Every format at one row and on the tensor-core path (2-16 rows; int4_bf16x: int4 weights under
    bf16 activations, the hi + lo split of both operands)."""
    g = gen(7)
    N, K = 40, 192                                 # N not a multiple of BLOCK_N
    dtype = torch.bfloat16 if fmt in ("bf16", "int4_bf16x") else torch.float32
    x = rand(M, K, g=g, dtype=dtype)
    scale = mn = None
    if fmt in ("fp32", "bf16"):
        w = rand(N, K, g=g, dtype=dtype)
    elif fmt.startswith("int8"):
        w, scale = _q8(N, K, g, per_row=fmt == "int8_row")
    else:
        w, scale, mn = _q4(N, K, g)
    w, scale, mn = (t.to(DEV) if t is not None else None for t in (w, scale, mn))
    want = matvec.matvec_ref(x, w, scale, mn)
    got = matvec.matvec(x, w, scale, mn, block_n=16, block_k=32, split_k=split_k)
    tol = BF16 if dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-3)
    if scale is not None and M > 1 and dtype == torch.float32:
        tol = SPLIT16
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # accumulate into an existing output (residual add)
    base = rand(M, N, g=g, dtype=dtype)
    got2 = matvec.matvec(x, w, scale, mn, out=base.clone(), accumulate=True, block_n=16, block_k=32,
                         split_k=split_k)
    torch.testing.assert_close(got2.float(), matvec.matvec_ref(x, w, scale, mn, base, True).float(), **tol)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8_group", "int4"])
@pytest.mark.parametrize("M,split_k", [(1, 1), (3, 3)])
def test_matvec_fused_norm_and_swiglu(fmt, M, split_k):
    """The RMSNorm prologue and the SwiGLU epilogue (also through split-K's reduce) against
    rms_norm -> product -> silu(gate) * up in torch."""
    g = gen(11)
    F, K = 24, 192                                  # gate/up rows: 2 x 24, F not a multiple of BLOCK_N
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    x = rand(M, K, g=g, dtype=dtype) * 3
    nw = (1 + 0.1 * rand(K, g=g)).float()
    scale = mn = None
    if fmt in ("fp32", "bf16"):
        w = rand(2 * F, K, g=g, dtype=dtype)
    elif fmt.startswith("int8"):
        w, scale = _q8(2 * F, K, g)
    else:
        w, scale, mn = _q4(2 * F, K, g)
    w, scale, mn = (t.to(DEV) if t is not None else None for t in (w, scale, mn))
    tol = BF16 if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    if scale is not None and M > 1:
        tol = SPLIT16
    kw = dict(block_n=16, block_k=32, split_k=split_k)
    got = matvec.matvec(x, w, scale, mn, norm_weight=nw, eps=1e-5, glu=True, **kw)
    assert got.shape == (M, F)
    torch.testing.assert_close(got.float(), matvec.matvec_ref(x, w, scale, mn, norm_weight=nw, eps=1e-5,
                                                             glu=True).float(), **tol)
    # the norm alone (QKV and the LM head), accumulating into an output too
    base = rand(M, 2 * F, g=g, dtype=dtype)
    got = matvec.matvec(x, w, scale, mn, out=base.clone(), accumulate=True, norm_weight=nw, eps=1e-5, **kw)
    torch.testing.assert_close(got.float(), matvec.matvec_ref(x, w, scale, mn, base, True, nw, 1e-5).float(),
                               **tol)


def test_greedy_ties_lowest_index():
    g = gen(8)
    B, V = 4, 1000
    logits = rand(B, V, g=g)
    logits[1, 10] = logits[1, 900] = 50.0          # tie across tiles
    logits[2, 300] = logits[2, 301] = 50.0         # tie inside a tile
    logits[3, :] = 1.0                             # all equal
    got = sample.greedy(logits, block=256)
    assert got.tolist() == sample.greedy_ref(logits).tolist()
    assert got[1].item() == 10 and got[2].item() == 300 and got[3].item() == 0
    assert got[0].item() == int(torch.argmax(logits[0]))
