"""The whole-step graph runtime against the eager step: uncaptured under Triton's interpreter on a
CPU (the same launches over the same static buffers that a CUDA graph records), captured on a GPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from support import decode_step, prefill_step  # noqa: E402

from slipstream.kernels.triton.configs import KernelConfigs  # noqa: E402
from slipstream.kv.blocks import SequenceKV  # noqa: E402
from slipstream.models.llama import LlamaModel  # noqa: E402
from slipstream.models.random_init import random_llama, shape_config  # noqa: E402
from slipstream.runtime.buckets import batch_buckets, context_buckets  # noqa: E402
from slipstream.runtime.graph import GraphDecoder  # noqa: E402

BLOCK = 4
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # uncaptured on a GPU too: the same launches


def _model(seed: int, **cfg):
    return random_llama(shape_config("tiny", **cfg), seed=seed, device=DEV)
# small tiles and partitions so that split-K matvecs and several attention splits actually run
CONFIGS = KernelConfigs(matvec={}, attention={"partition": 16, "block_n": 8})


def _prefill(model: LlamaModel, kv, seq: SequenceKV, prompt: list[int]) -> int:
    return int(model.forward(prefill_step(seq, prompt), kv).argmax())


def _run(model: LlamaModel, capture: bool, configs: KernelConfigs, steps: int = 4, max_batch: int = 4):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4], [42]]
    kv_e, kv_g = model.new_kv_cache(64, BLOCK), model.new_kv_cache(64, BLOCK)
    graph = GraphDecoder(model, kv_g, max_batch=max_batch, max_context=64, capture=capture, configs=configs)
    seqs_e, seqs_g = [SequenceKV(kv_e) for _ in prompts], [SequenceKV(kv_g) for _ in prompts]
    seqs_g[1].reserve(3)   # a different block layout in the graph's cache: the tables differ
    tokens = [_prefill(model, kv_e, s, p) for s, p in zip(seqs_e, prompts)]
    for s, p in zip(seqs_g, prompts):
        _prefill(model, kv_g, s, p)
    positions = [len(p) for p in prompts]
    for _ in range(steps):
        le = model.forward(decode_step(seqs_e, tokens, positions), kv_e).cpu()
        lg = graph.forward(decode_step(seqs_g, tokens, positions))
        assert lg.shape == le.shape and lg.device.type == "cpu"
        assert (le - lg).abs().max().item() < 1e-4 * max(1.0, le.abs().max().item())
        assert le.argmax(-1).tolist() == lg.argmax(-1).tolist()
        if max_batch >= 3:   # the device-side greedy choice agrees with the host's
            assert graph.static(3).next_tokens[:3].cpu().tolist() == lg.argmax(-1).tolist()
        tokens = le.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    return graph


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 8]
    assert context_buckets(512) == [512]
    assert context_buckets(4096) == [512, 2048, 4096]
    assert context_buckets(131072) == [512, 2048, 8192, 32768, 131072]


def test_graph_body_matches_eager_with_padding_and_split_k():
    model = _model(3)
    split = KernelConfigs(matvec={"4,128,64": {"block_n": 16, "block_k": 16, "split_k": 2, "num_warps": 4}},
                          attention=CONFIGS.attention)
    graph = _run(model, capture=False, configs=split)
    s = graph.static(3)
    assert s.batch == 4 and s.slots[3].item() == -1      # batch 3 ran padded to the 4-bucket
    assert (128, 64) in s.matvec_ws                       # the fused QKV product used split-K


def test_more_rows_than_the_largest_bucket_run_as_several_replays():
    """Three sequences through buckets of at most two rows (as a speculative step's K + 1 rows
    per sequence would exceed the largest bucket): replayed in order, the same logits."""
    graph = _run(_model(9), capture=False, configs=CONFIGS, steps=2, max_batch=2)
    assert graph.max_rows == 2 and set(graph._static) == {(1, 64), (2, 64)}


def test_qkv_biases_and_qk_norms_are_applied():
    """Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorm, through the same captured body."""
    model = _model(8)
    D = model.cfg.head_dim
    g = torch.Generator().manual_seed(0)
    for L in model.layers:
        L.qkv.bias = (0.1 * torch.randn(L.qkv.n, generator=g)).to(DEV)
        L.q_norm = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV)
        L.k_norm = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV)
    _run(model, capture=False, configs=CONFIGS, steps=2)


def test_padded_rows_leave_the_cache_alone():
    model = _model(4)
    kv = model.new_kv_cache(16, BLOCK)
    kv.k.zero_()
    kv.v.zero_()
    graph = GraphDecoder(model, kv, max_batch=4, max_context=32, capture=False, configs=CONFIGS)
    seqs = [SequenceKV(kv) for _ in range(3)]
    for seq, prompt in zip(seqs, ([5, 6, 7], [8, 9, 10], [11, 12, 13])):
        _prefill(model, kv, seq, prompt)
    before_k, before_v = kv.k.clone(), kv.v.clone()
    graph.forward(decode_step(seqs, [8, 9, 10], [3, 3, 3]))    # 3 rows in the 4-bucket: one padded
    graph.forward(decode_step(seqs, [1, 2, 3], [4, 4, 4]))
    assert graph.static(3).batch == 4 and graph.static(3).slots[3].item() == -1
    written = sorted(t for seq in seqs for t in seq.slots(3, 5).tolist())
    for cache, before in ((kv.k, before_k), (kv.v, before_v)):
        changed = (cache != before).any(-1).any(-1).any(0).nonzero().flatten().tolist()
        assert changed == written


def test_rejects_prefill_and_oversize():
    model = _model(5)
    kv = model.new_kv_cache(16, BLOCK)
    graph = GraphDecoder(model, kv, max_batch=2, max_context=32, capture=False, configs=CONFIGS)
    seq = SequenceKV(kv)
    step = prefill_step(seq, [1, 2], extra=2)
    with pytest.raises(ValueError, match="one token per sequence"):
        graph.forward(step)
    with pytest.raises(ValueError, match="exceeds the largest"):
        graph.static(3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graph_matches_eager_on_gpu():
    model = _model(6)
    graph = _run(model, capture=True, configs=KernelConfigs(), steps=6)
    assert all(s.graph is not None for s in graph._static.values())
