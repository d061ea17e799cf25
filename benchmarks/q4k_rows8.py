"""Decode steps of a random Llama whose products, embedding and LM head are Q4_K matrices (kept as a GGUF's are:
6-bit scales and mins, fp16 d and dmin), with the AVX2 fast path's q4 products one weight row at a time
(`q4p_row`, paired activations) and 8 at a time (`q4i_rows8`), alternating in process (`ss_set_rows8`).

No llama.cpp needed (benchmarks/kquant_model.py makes real K-quant files with its quantizer): the super-blocks are
random bytes, which is all a product's speed depends on. Run it on an AVX2 build:

    SLIPSTREAM_MARCH=x86-64-v3 python benchmarks/q4k_rows8.py
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from slipstream.kernels.cpu import load_library
from slipstream.kv.blocks import SequenceKV
from slipstream.models.random_init import random_llama, shape_config
from slipstream.runtime.cpu_team import CpuTeamDecoder
from slipstream.step import decode_step, prefill_step
from slipstream.weights.gguf import _q4k_linear


def q4k_random(n: int, k: int, rng: np.random.Generator):
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    for lo, hi in ((0, 2), (2, 4)):   # small fp16 d and dmin
        blocks[..., lo:hi] = rng.uniform(0.001, 0.01, (n, k // 256)).astype(np.float16)[..., None].view(np.uint8)
    return _q4k_linear(blocks.reshape(-1), n, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per", type=int, default=15, help="timed steps per setting and round")
    args = ap.parse_args()
    lib = load_library()
    if lib is None or not lib.ss_set_rows8(1):
        raise SystemExit("this build has no 8-row AVX2 q4 kernel (needs an AVX2 build: SLIPSTREAM_MARCH=x86-64-v3)")
    rng = np.random.default_rng(4)
    cfg = shape_config("tiny", hidden_size=args.hidden, head_dim=64, intermediate_size=args.ffn,
                       num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=args.hidden // 256,
                       vocab_size=args.vocab)
    model = random_llama(cfg, seed=3)
    model.layers = [dataclasses.replace(L, qkv=q4k_random(L.qkv.n, L.qkv.k, rng), o=q4k_random(L.o.n, L.o.k, rng),
                                        gate_up=q4k_random(L.gate_up.n, L.gate_up.k, rng),
                                        down=q4k_random(L.down.n, L.down.k, rng)) for L in model.layers]
    model.embed = model.lm_head = q4k_random(cfg.vocab_size, cfg.hidden_size, rng)
    kv = model.new_kv_cache(64)
    team = CpuTeamDecoder(model, kv, exact=False)
    seqs = [SequenceKV(kv) for _ in range(8)]
    for i, s in enumerate(seqs):
        s.reserve(3 + 64)
        model.forward(prefill_step(s, [1 + i, 7, 9 + i], gather=True), kv)
    print(f"ISA {lib.ss_isa().decode()}; hidden {args.hidden}, ffn {args.ffn}, {args.layers} layers, "
          f"vocab {cfg.vocab_size}, every matrix Q4_K")
    for b in (1, 8):
        med: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(args.rounds):
            for v in (0, 1):
                lib.ss_set_rows8(v)
                times = []
                for _ in range(args.per):
                    t0 = time.perf_counter()
                    team.forward(decode_step(seqs[:b], [3] * b, [3] * b, gather=True))
                    times.append(time.perf_counter() - t0)
                med[v].append(statistics.median(times) * 1e3)
        one, eight = statistics.median(med[0]), statistics.median(med[1])
        print(f"batch {b}: one row at a time {one:.2f} ms, 8 rows at a time {eight:.2f} ms ({eight / one:.3f}x)")
    lib.ss_set_rows8(15)


if __name__ == "__main__":
    main()
