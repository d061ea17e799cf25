"""Converted weights moved into one huge-page mapping (weights/hugepages.py): same values, each tensor
once, nothing read in place from the file moved, and the default model loaded that way."""
from __future__ import annotations

import pytest
import torch
from support import skip_unless_default_model

from slipstream.weights import hugepages
from slipstream.weights.quant import Q8_0, Linear


def _lin(n: int, k: int, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return Linear(n, k, q, Q8_0, torch.rand(n, k // 32, generator=g).half(), bias=torch.randn(n, generator=g))


def test_moves_values_once_and_leaves_mapped_tensors(monkeypatch):
    monkeypatch.setattr(hugepages, "huge_pages_available", lambda: True)
    big, tied, mapped = _lin(4096, 1024, 1), _lin(512, 1024, 2), _lin(256, 1024, 3)
    fields = ("data", "scale", "bias")   # Q8_0: no min plane
    before = {id(x): [getattr(x, f).clone() for f in fields] for x in (big, tied, mapped)}
    mapped_ptr = mapped.data.data_ptr()
    weights = {"layers.0": big, "embed": tied, "lm_head": tied, "other": mapped}
    moved = hugepages.move_to_huge_pages(weights, (mapped_ptr, mapped.data.numel()))
    if moved == 0:
        pytest.skip("this kernel refused an anonymous MADV_HUGEPAGE mapping")
    for x in (big, tied, mapped):
        for f, old in zip(fields, before[id(x)]):
            new = getattr(x, f)
            assert new.dtype == old.dtype and new.shape == old.shape and torch.equal(new, old)
            assert new.data_ptr() % hugepages.ALIGN == 0
    assert mapped.data.data_ptr() == mapped_ptr                 # in the "file map": left in place
    assert weights["embed"] is weights["lm_head"]
    ptrs = sorted(getattr(x, f).data_ptr() for x in (big, tied) for f in fields)
    assert ptrs[0] % hugepages.HUGE == 0                         # the mapping starts on a huge page
    assert ptrs[-1] - ptrs[0] < moved                            # one mapping, each tensor once
    # moved: every tensor of the two Linears and the mapped one's scales and bias, 64-byte aligned
    tensors = [getattr(x, f) for x in (big, tied) for f in fields] + [mapped.scale, mapped.bias]
    size = sum(t.numel() * t.element_size() for t in tensors)
    assert size <= moved < size + 64 * len(tensors)

def test_a_q4_k_matrix_s_six_bit_scales_move_too(monkeypatch):
    """A Q4_K matrix holds its scales as `kq` (6-bit scales and mins, fp16 d and dmin): they move with its
    codes, unchanged."""
    import numpy as np

    from slipstream.weights.gguf import _q4k_linear
    monkeypatch.setattr(hugepages, "huge_pages_available", lambda: True)
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (8192, 4, 144), dtype=np.uint8)   # 4.7 MB: over MIN_BYTES
    blocks[..., 0:4] = np.frombuffer(np.float16([0.01, 0.002]).tobytes(), dtype=np.uint8)
    w = _q4k_linear(blocks.reshape(-1), 8192, 1024)
    assert w.kq is not None
    before = [t.clone() for t in (w.data, *w.kq)]
    moved = hugepages.move_to_huge_pages({"layers.0": w})
    if moved == 0:
        pytest.skip("this kernel refused an anonymous MADV_HUGEPAGE mapping")
    now = (w.data, *w.kq)
    assert all(torch.equal(a, b) and a.data_ptr() % hugepages.ALIGN == 0 for a, b in zip(now, before))
    assert moved >= sum(t.numel() * t.element_size() for t in now)
    assert max(t.data_ptr() for t in now) - min(t.data_ptr() for t in now) < moved   # one mapping


def test_small_weights_and_the_switch_stay_put(monkeypatch):
    monkeypatch.setattr(hugepages, "huge_pages_available", lambda: True)
    small = _lin(64, 64, 4)
    ptr = small.data.data_ptr()
    assert hugepages.move_to_huge_pages({"x": small}) == 0 and small.data.data_ptr() == ptr
    monkeypatch.undo()
    monkeypatch.setenv("SLIPSTREAM_HUGE_PAGES", "0")
    assert not hugepages.huge_pages_available()


def test_the_default_model_loads_into_one_mapping():
    skip_unless_default_model()
    if not hugepages.huge_pages_available():
        pytest.skip("no transparent huge pages on request here")
    from slipstream.weights import load_model
    w = load_model(None).weights
    lins = [w["embed"]] + [L for i in range(30) for L in w[f"layers.{i}"].linears()]
    ptrs = [x.data.data_ptr() for x in lins]
    span = max(ptrs) - min(ptrs)
    assert span < sum(x.nbytes for x in lins)                     # all inside one mapping
    assert min(ptrs) % hugepages.HUGE == 0
