"""The DeepSeek/GLM decode kernels (MoE, MLA absorbed attention, DSA top-k) against their torch
references, under Triton's interpreter on CPU (fp32; tolerances stated per test)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from slipstream.kernels.triton import dsa, mla, moe  # noqa: E402

D, FF, E, K, H, R, P, BS = 64, 32, 8, 2, 4, 32, 8, 16
DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _on(fn, *args, **kw):
    """Call a kernel wrapper with its tensors on DEV (cpu under the interpreter), result on cpu."""
    mv = lambda a: a.to(DEV) if isinstance(a, torch.Tensor) else a  # noqa: E731
    return fn(*map(mv, args), **{k: mv(v) for k, v in kw.items()}).cpu()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _routing(T: int, g: torch.Generator):
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return ids, w


# -- MoE -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 3])
def test_moe_fp32(T):
    g = _gen(T)
    x = torch.randn(T, D, generator=g)
    ids, w = _routing(T, g)
    gate_up = torch.randn(E, 2 * FF, D, generator=g) * D ** -0.5
    down = torch.randn(E, D, FF, generator=g) * FF ** -0.5
    out = _on(moe.moe_decode, x, ids, w, gate_up, down)
    torch.testing.assert_close(out, moe.moe_reference(x, ids, w, gate_up, down),
                               rtol=1e-5, atol=1e-5)


def test_moe_shared_expert_and_bf16_weights():
    """Two tokens picking the same expert; bf16 weights (fp32 accumulate) vs fp32 maths on them."""
    g = _gen(7)
    T = 2
    x = torch.randn(T, D, generator=g)
    ids = torch.tensor([[3, 5], [5, 0]])
    w = torch.rand(T, K, generator=g)
    gate_up = (torch.randn(E, 2 * FF, D, generator=g) * D ** -0.5).bfloat16()
    down = (torch.randn(E, D, FF, generator=g) * FF ** -0.5).bfloat16()
    out = _on(moe.moe_decode, x, ids, w, gate_up, down)
    ref = moe.moe_reference(x, ids, w, gate_up, down)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [None, 32])
def test_moe_int8(group):
    g = _gen(11)
    T = 3
    x = torch.randn(T, D, generator=g)
    ids, w = _routing(T, g)
    gu_q, gu_s = moe.quantize_int8(torch.randn(E, 2 * FF, D, generator=g) * D ** -0.5, group)
    dn_q, dn_s = moe.quantize_int8(torch.randn(E, D, FF, generator=g) * FF ** -0.5, group)
    out = _on(moe.moe_decode_int8, x, ids, w, gu_q, gu_s, dn_q, dn_s)
    ref = moe.moe_int8_reference(x, ids, w, gu_q, gu_s, dn_q, dn_s)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# -- MLA -----------------------------------------------------------------------------------------
def _cache(g, num_blocks=8):
    latent = torch.randn(num_blocks * BS, R, generator=g)
    k_pe = torch.randn(num_blocks * BS, P, generator=g)
    return latent, k_pe


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_paged(splits):
    """Two sequences, non-contiguous block tables, contexts 40 and 17."""
    g = _gen(splits)
    latent, k_pe = _cache(g)
    table = torch.tensor([[5, 1, 6], [2, 7, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 17])
    B = 2
    q_abs, q_pe = torch.randn(B, H, R, generator=g), torch.randn(B, H, P, generator=g)
    scale = (R + P) ** -0.5
    out = _on(mla.mla_decode, q_abs, q_pe, latent, k_pe, lens, scale, block_table=table,
                         block_size=BS, num_splits=splits)
    slots = mla.block_table_to_slots(table, lens, BS)
    ref = mla.mla_decode_reference(q_abs, q_pe, latent, k_pe, slots, lens, scale)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_mla_slot_list_matches_eager_absorbed():
    """Slot-list mode vs the model's own `_mla_absorbed` maths (W_uk folded, W_uv after)."""
    g = _gen(21)
    latent, k_pe = _cache(g)
    slots = torch.randperm(latent.shape[0], generator=g)[:23].view(1, -1)
    lens = torch.tensor([23])
    dn, dv = 16, 16
    q_nope, q_pe = torch.randn(1, H, dn, generator=g), torch.randn(1, H, P, generator=g)
    w_uk, w_uv = torch.randn(H, dn, R, generator=g) * 0.2, torch.randn(H, dv, R, generator=g)
    scale = (dn + P) ** -0.5
    q_abs = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
    o_lat = _on(mla.mla_decode, q_abs, q_pe, latent, k_pe, lens, scale, slots=slots, num_splits=2)
    out = torch.einsum("nhr,hdr->nhd", o_lat, w_uv)
    lat, pe = latent[slots[0]], k_pe[slots[0]]
    s = (torch.einsum("nhr,cr->hnc", q_abs, lat) + torch.einsum("nhd,cd->hnc", q_pe, pe)) * scale
    eager = torch.einsum("nhr,hdr->nhd", torch.einsum("hnc,cr->nhr", s.softmax(-1), lat), w_uv)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


# -- DSA -----------------------------------------------------------------------------------------
def test_dsa_scores_topk_and_sparse_attention():
    g = _gen(31)
    Hi, Di, topk = 4, 32, 12
    num_blocks = 8
    k_idx = torch.randn(num_blocks * BS, Di, generator=g)
    table = torch.tensor([[6, 0, 3], [4, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([37, 9])          # the second context is shorter than topk: all of it
    B = 2
    q = torch.randn(B, Hi, Di, generator=g)
    head_w = torch.randn(B, Hi, generator=g) * Hi ** -0.5
    scale = Di ** -0.5
    scores = _on(dsa.index_scores, q, k_idx, head_w, table, lens, scale, block_size=BS)
    slots = mla.block_table_to_slots(table, lens, BS, max_len=table.shape[1] * BS)
    ref_scores = dsa.index_scores_reference(q, k_idx, head_w, slots, lens, scale)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)

    pos = _on(dsa.topk_select, scores, lens, topk)
    torch.testing.assert_close(pos, dsa.topk_reference(ref_scores, lens, topk))
    # the same set as torch.topk (random scores: no ties)
    assert set(pos[0].tolist()) == set(ref_scores[0, :37].topk(topk).indices.tolist())
    assert sorted(pos[1, :9].tolist()) == list(range(9)) and (pos[1, 9:] == -1).all()

    # attention restricted to the selection, through mla_decode's slot list
    latent, k_pe = _cache(g, num_blocks)
    q_abs, q_pe = torch.randn(B, H, R, generator=g), torch.randn(B, H, P, generator=g)
    sel_slots = dsa.positions_to_slots(pos, table, BS)
    sel_lens = lens.clamp_max(topk)
    out = _on(mla.mla_decode, q_abs, q_pe, latent, k_pe, sel_lens, 0.3, slots=sel_slots)
    ref = mla.mla_decode_reference(q_abs, q_pe, latent, k_pe, sel_slots, sel_lens, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_topk_ties_lowest_position_first():
    s = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, -0.0, 0.0, 2.0, 0.5],
                      [0.0, -0.0, 0.0, 0.0, 5.0, -1.0, 0.0, 0.0, 0.0, 0.0]])
    lens = torch.tensor([10, 8])
    pos = _on(dsa.topk_select, s, lens, 4)
    assert pos.tolist() == [[1, 2, 3, 4], [0, 1, 2, 4]]
    torch.testing.assert_close(pos, dsa.topk_reference(s, lens, 4))
