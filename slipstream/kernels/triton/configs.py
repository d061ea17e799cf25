"""Launch configurations of the decode kernels: defaults by shape, tuning by measurement, and the
JSON form that `slipstream compile` stores in an artifact so that start-up does no tuning.

A matvec's best tile depends on (N, K) and the batch rows M: the grid must cover the GPU's SMs
(split-K when N / block_n is small) while each program's [M, block_n, block_k] product stays in
registers. The candidates below are timed on the device that will run them (`tune_matvec`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

DEFAULT_SMS = 132   # H100 SXM; read from the device when there is one

# (block_n, block_k, split_k, num_warps) tried by `tune_matvec`
MATVEC_CANDIDATES: list[tuple[int, int, int, int]] = [
    (bn, bk, sk, nw) for bn in (8, 16, 32, 64) for bk in (64, 128, 256) for sk in (1, 2, 4, 8) for nw in (4,)
]


def _sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).multi_processor_count
    return DEFAULT_SMS


def default_matvec(n: int, k: int) -> dict[str, int]:
    """A heuristic tile: enough programs to cover every SM about twice, split-K when N alone
    cannot, each K-split at least 512 wide. Without a GPU (Triton's interpreter, where every program
    costs Python time) few large tiles."""
    if not torch.cuda.is_available():
        return {"block_n": 128, "block_k": 64, "split_k": 1, "num_warps": 4}
    block_n, block_k = 16, 128
    tiles = -(-n // block_n)
    split = 1
    while tiles * split < 2 * _sms() and k // (split * 2) >= 512 and split < 8:
        split *= 2
    return {"block_n": block_n, "block_k": block_k, "split_k": split, "num_warps": 4}


@dataclass
class KernelConfigs:
    """Chosen launch parameters, keyed by shape; anything not tuned falls back to the defaults."""
    matvec: dict[str, dict[str, int]] = field(default_factory=dict)    # "M,N,K" -> params
    attention: dict[str, int] = field(default_factory=lambda: {"partition": 256, "block_n": 16})
    device: str = ""    # the GPU the configs were tuned on ("" = defaults)

    def matvec_for(self, m: int, n: int, k: int) -> dict[str, int]:
        return self.matvec.get(f"{m},{n},{k}") or default_matvec(n, k)

    def attention_for(self, batch: int, context: int, kv_heads: int) -> dict[str, int]:
        """The split-K attention's partition and tile for a (batch, context) bucket: the tuned ones,
        and without a GPU (the interpreter) the stored defaults; untuned on a GPU, partitions short
        enough that batch x kv heads x splits reach about the SM count (at least 95% of it; a power of
        two, at least 16 tokens), each walked in one tile of up to 64 tokens (its block-table slice
        loaded once)."""
        if self.device or not torch.cuda.is_available():
            return self.attention
        enough = 0.95 * _sms()
        part = 16
        # bounded by the context: with many rows x heads the program count never drops below `enough`
        while part < context and batch * kv_heads * -(-context // (part * 2)) >= enough:
            part *= 2
        return {"partition": part, "block_n": min(part, 64)}

    def to_json(self) -> str:
        return json.dumps({"matvec": self.matvec, "attention": self.attention, "device": self.device},
                          indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "KernelConfigs":
        d = json.loads(text)
        return KernelConfigs(matvec=d.get("matvec", {}), attention=d.get("attention", {"partition": 256, "block_n": 16}),
                             device=d.get("device", ""))


def _time(fn: Callable[[], object], reps: int) -> float:
    """Median seconds per call (CUDA events on a GPU)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def tune_matvec(shapes: list[tuple[int, int, int]], dtype: torch.dtype = torch.bfloat16,
                device: str = "cuda", candidates: list[tuple[int, int, int, int]] | None = None,
                reps: int = 20, configs: KernelConfigs | None = None) -> KernelConfigs:
    """Times every candidate tile on each (M, N, K) (dense weights of `dtype`), checks its result
    against the torch reference, and keeps the fastest correct one."""
    from slipstream.kernels.triton.matvec import matvec, matvec_ref

    configs = configs or KernelConfigs()
    candidates = candidates or MATVEC_CANDIDATES
    for m, n, k in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.float32)
        w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=dtype)
        ref = matvec_ref(x, w)
        best: tuple[float, dict] | None = None
        for bn, bk, sk, nw in candidates:
            if bk > k:
                continue
            params = {"block_n": bn, "block_k": bk, "split_k": sk, "num_warps": nw}
            ws = torch.empty((sk, m, n), dtype=torch.float32, device=device) if sk > 1 else None
            out = torch.empty(m, n, dtype=torch.float32, device=device)
            run = lambda: matvec(x, w, out=out, workspace=ws, **params)  # noqa: E731
            try:
                run()
            except Exception:   # a tile the compiler rejects (registers, shared memory): skip it
                continue
            if not torch.allclose(out, ref, atol=1e-2, rtol=1e-2):
                continue
            t = _time(run, reps)
            if best is None or t < best[0]:
                best = (t, params)
        if best is not None:
            configs.matvec[f"{m},{n},{k}"] = best[1]
    configs.device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return configs


def decode_shapes(cfg, batches: list[int]) -> list[tuple[int, int, int]]:
    """The (M, N, K) matvecs of a Llama-family decode step at the given batch sizes."""
    H, KVH, D, Hd, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    nk = [((H + 2 * KVH) * D, Hd), (Hd, H * D), (2 * F, Hd), (Hd, F), (cfg.vocab_size, Hd)]
    return [(m, n, k) for m in batches for n, k in nk]
