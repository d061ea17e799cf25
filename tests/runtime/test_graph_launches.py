"""The graph runtime's step as a GPU would capture it: its Triton launches, recorded on "meta" tensors
with CUDA reported available (132 SMs), so the GPU's tiles and split-K are chosen. Each launch in a
CUDA graph costs about a microsecond and a half even when replayed (docs/GPU_MODEL.md): split-K is
reduced inside the matvec kernel, so a step is 7 launches per layer plus the LM head and the argmax."""
from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("triton")

from slipstream.kernels.triton import offline  # noqa: E402
from slipstream.models.random_init import shape_config  # noqa: E402
from slipstream.runtime.graph import meta_decoder  # noqa: E402


@pytest.mark.parametrize("shape,batch", [("dense-1B", 1), ("dense-1B", 8), ("dense-8B", 4)])
def test_launches_per_step_have_a_ceiling(shape, batch):
    cfg = shape_config(shape)
    with offline.as_gpu(132):
        dec, s = meta_decoder(cfg, batch, 512)
        down_split = dec.configs.matvec_for(batch, cfg.hidden_size, cfg.intermediate_size)["split_k"]
        with offline.record() as launches:
            dec._body(s)
    assert down_split > 1, "the down projection should use split-K on 132 SMs (else this test checks nothing)"
    kinds = Counter(ln.kernel for ln in launches)
    assert len(launches) <= 7 * cfg.num_layers + 2, kinds     # + the embedding copy (a torch op)
    assert kinds["matvec._matvec_kernel"] == 4 * cfg.num_layers + 1
    assert not any("reduce" in k and "matvec" in k for k in kinds), kinds


@pytest.mark.parametrize("batch,context,kv_heads", [(1, 512, 8), (8, 512, 32), (16, 64, 8), (1, 131072, 8)])
def test_untuned_attention_partitions_fill_the_sms_and_stay_in_the_context(batch, context, kv_heads):
    from slipstream.kernels.triton.configs import KernelConfigs
    with offline.as_gpu(132):
        att = KernelConfigs().attention_for(batch, context, kv_heads)
    part = att["partition"]
    programs = batch * kv_heads * -(-context // part)
    assert part >= 16 and part & (part - 1) == 0 and att["block_n"] == min(part, 64)
    assert part <= max(16, context)
    assert programs >= 0.95 * 132 or part == 16          # enough programs, unless already the smallest
    assert part == 16 or part >= context or batch * kv_heads * -(-context // (part // 2)) >= 0.95 * 132
