"""Tensor parallelism without a process group: how a rank cuts its shard from packed weights (kept
packed where the cut falls on their blocks, float32 a few rows at a time where it does not; equal to
the same slice of the whole dequantized weight), and how a rank picks its backend and device (NCCL on
cuda:LOCAL_RANK where CUDA is available, with torch.cuda mocked here: no GPU runs these tests)."""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from slipstream.distributed import tensor_parallel as tp
from slipstream.errors import SlipstreamError
from slipstream.weights.quant import Linear

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType
N, K = 40, 512


def packed(qt: "gguf.GGMLQuantizationType", seed: int = 0) -> Linear:
    from slipstream.weights.gguf import _linear_from_raw

    g = np.random.default_rng(seed)
    if qt == QT.Q6_K:   # gguf-py cannot quantize it: random blocks with a sane fp16 scale (last 2 bytes)
        raw = g.integers(0, 256, size=(N, K // 256, 210), dtype=np.uint8)
        raw[..., 208:210] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        raw = raw.reshape(N, -1)
    elif qt == QT.Q4_K:   # nor this one: random blocks with small fp16 d and dmin (the first 4 bytes)
        raw = g.integers(0, 256, size=(N, K // 256, 144), dtype=np.uint8)
        raw[..., 0:4] = np.frombuffer(np.float16([0.01, 0.005]).tobytes(), dtype=np.uint8)
        raw = raw.reshape(N, -1)
    else:
        raw = gguf.quants.quantize(g.standard_normal((N, K)).astype(np.float32), qt)
    w = _linear_from_raw(qt, raw, N, K)
    assert w.packed
    w.bias = torch.randn(N, generator=torch.Generator().manual_seed(seed))
    return w


def assert_products(cut: Linear) -> None:
    """The cut runs through the kernels as any weight (one row: the native matvec; 40: the dense
    path) and matches a float64 product over its dequantized values."""
    g = torch.Generator().manual_seed(1)
    for rows in (1, 40):
        x = torch.randn(rows, cut.k, generator=g)
        ref = x.double() @ cut.dequantize().double().T + (0 if cut.bias is None else cut.bias.double())
        err = (cut(x).double() - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), (rows, err)


FORMATS = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.F16, QT.Q6_K, QT.Q4_K]


@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_rows_stay_packed_and_equal_the_slice(qt):
    w = packed(qt)
    rows = torch.tensor([3, 4, 5, 20, 39])
    cut = tp._rows(w, rows)
    assert cut.packed and cut.n == 5
    assert torch.equal(cut.dequantize(), w.dequantize()[rows])
    assert torch.equal(cut.bias, w.bias[rows])
    assert_products(cut)


@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("c0,c1", [(256, 512), (0, 256), (64, 192), (16, 80)])
def test_columns_equal_the_slice(qt, c0, c1):
    w = packed(qt)
    cut = tp._cols(w, c0, c1, bias=c0 == 0)
    block = 32 if qt == QT.Q4_K else gguf.GGML_QUANT_SIZES[qt][0]   # Q4_K is kept in groups of 32
    assert cut.packed == (c0 % block == 0 and c1 % block == 0)   # in place on block boundaries only
    assert (cut.n, cut.k) == (N, c1 - c0)
    assert torch.equal(cut.dequantize(), w.dequantize()[:, c0:c1])
    assert (cut.bias is not None) == (c0 == 0)   # a row-parallel bias: rank 0's alone
    if qt == QT.Q4_K:   # its 6-bit form kept on super-blocks of 256, fp32 planes made for other cuts
        assert (cut.kq is not None) == (c0 % 256 == 0 and c1 % 256 == 0)
    assert_products(cut)


def test_misaligned_columns_are_dequantized_in_chunks(monkeypatch):
    monkeypatch.setattr(tp, "ROW_CHUNK", 7)
    w = packed(QT.Q6_K)
    assert torch.equal(tp._cols(w, 64, 192, bias=False).dequantize(), w.dequantize()[:, 64:192])


def test_a_loaded_model_shards_into_its_pieces():
    """Rows of QKV / gate-up and columns of O / down over two ranks put back together give the
    whole (dense) weights; the loader's dict is emptied as it goes."""
    import tp_workers

    full = tp_workers.tiny_llama("qwen3")
    c = full.cfg
    parts = []
    for r in range(2):
        w = tp._model_weights(full)
        cfg, shard, lo = tp.shard_llama_weights(c, w, 2, r)
        assert not any(k.startswith("layers.") for k in w) and "embed" not in w
        assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (2, 1, 48) and lo == 64 * r
        parts.append(shard)
    L, a, b = full.layers[1], parts[0]["layers.1"], parts[1]["layers.1"]
    assert torch.equal(torch.cat([a.o.data, b.o.data], 1), L.o.data)
    assert torch.equal(torch.cat([a.down.data, b.down.data], 1), L.down.data)
    assert torch.equal(torch.cat([parts[0]["lm_head"].data, parts[1]["lm_head"].data]), full.lm_head.data)
    D, H = c.head_dim, c.num_heads
    assert torch.equal(a.qkv.data[:2 * D], L.qkv.data[:2 * D])            # rank 0: heads 0, 1
    assert torch.equal(b.qkv.data[2 * D:3 * D], L.qkv.data[(H + 1) * D:(H + 2) * D])   # rank 1: KV head 1


# -- backend and device ------------------------------------------------------------------------------

def cuda(count: int):
    return mock.patch.multiple(torch.cuda, is_available=lambda: count > 0, device_count=lambda: count)


def test_cpu_is_gloo(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_TP_DEVICE", raising=False)
    with cuda(0):
        assert tp.rank_device(2, 1) == ("gloo", torch.device("cpu"))
    with cuda(4):
        monkeypatch.setenv("SLIPSTREAM_TP_DEVICE", "cpu")
        assert tp.rank_device(2, 1) == ("gloo", torch.device("cpu"))


def test_cuda_is_nccl_one_rank_per_gpu(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_TP_DEVICE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with cuda(2):
        assert tp.rank_device(2, 0) == ("nccl", torch.device("cuda", 0))
        assert tp.rank_device(2, 1) == ("nccl", torch.device("cuda", 1))
        monkeypatch.setenv("LOCAL_RANK", "1")   # torchrun's placement wins over the global rank
        assert tp.rank_device(2, 0) == ("nccl", torch.device("cuda", 1))


def test_fewer_gpus_than_ranks_is_refused(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_TP_DEVICE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with cuda(1), pytest.raises(SlipstreamError, match="this machine has 1 CUDA device"):
        tp.rank_device(2, 0)
    monkeypatch.setenv("SLIPSTREAM_TP_DEVICE", "cuda")
    with cuda(0), pytest.raises(SlipstreamError, match="no CUDA device"):
        tp.rank_device(2, 0)


def test_the_launcher_refuses_before_starting_ranks(monkeypatch):
    from slipstream.distributed import tp_launch
    from slipstream.engine.config import EngineConfig

    monkeypatch.delenv("SLIPSTREAM_TP_DEVICE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with cuda(1), mock.patch.object(tp_launch.mp, "get_context") as ctx, \
            pytest.raises(SlipstreamError, match="one rank per GPU"):
        tp_launch.tensor_parallel_llm(None, EngineConfig(), 2)
    ctx.assert_not_called()
    assert tp_launch._device_of(torch.device("cuda", 0), 3) == torch.device("cuda", 3)
    assert tp_launch._device_of(torch.device("cpu"), 3) == torch.device("cpu")


def test_nccl_group_setup(monkeypatch):
    """A CUDA rank selects its device before joining an NCCL group, and step descriptions travel over
    a gloo group beside it (collectives on device tensors stay on NCCL)."""
    from slipstream.distributed import tp_launch

    control = object()
    with mock.patch.object(torch.cuda, "set_device") as set_device, \
            mock.patch.multiple(tp_launch.dist, init_process_group=mock.DEFAULT, get_backend=lambda: "nccl",
                                get_world_size=lambda group=None: 2, get_rank=lambda group=None: 1) as d, \
            mock.patch.object(tp.dist, "new_group", return_value=control) as new_group:
        comm = tp_launch._init_group("nccl", torch.device("cuda", 1), "tcp://127.0.0.1:1", 1, 2)
    set_device.assert_called_once_with(torch.device("cuda", 1))
    assert d["init_process_group"].call_args.args[0] == "nccl"
    new_group.assert_called_once_with(backend="gloo")
    assert comm.control is control and (comm.world, comm.rank) == (2, 1)
