"""Multiply-add rate of the native CPU step's product kernels alone, per weight type, ISA build and row count.

One matrix of random weights (`--n` x `--k`, quantized by gguf-py, or hand-made blocks for the types it
cannot quantize) small enough to stay in cache, multiplied by 1 and by 8 activation rows through the
library's `ss_matmul` (the step's own row kernels; fast path: int8 activations) on ONE thread, so the
figure is what a core's vector units give, with memory out of the way. The batch-8 step is bound by
this rate once the weights stop being the limit: whole-step multiply-adds / (threads x rate) is the
least time its products can take.

    python benchmarks/kernel_rate.py                                   # this CPU's own build
    SLIPSTREAM_MARCH=x86-64-v3 python benchmarks/kernel_rate.py        # the AVX2 build (no VNNI)
    SLIPSTREAM_MARCH=alderlake python benchmarks/kernel_rate.py        # AVX2 + AVX-VNNI, no AVX-512
    python benchmarks/kernel_rate.py --types Q4_1 Q8_0 --k 1536 --repeats 50

Prints one line per (type, rows): median ms per product, GMAC/s, and the weight bytes per second.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")   # before the library loads: one thread's rate

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # support.random_blocks


def weight(type_name: str, n: int, k: int):
    import gguf

    from slipstream.weights.gguf import _linear_from_raw
    from slipstream.weights.gguf_file import GGMLType

    qt = gguf.GGMLQuantizationType[type_name]
    w = (np.random.default_rng(0).standard_normal((n, k)) * 0.05).astype(np.float32)
    try:
        raw = gguf.quants.quantize(w, qt)
    except NotImplementedError:   # the K-quants, IQ types: hand-made valid blocks of that magnitude
        from support import random_blocks
        raw = random_blocks(int(qt), n, k, size=0.15)
    return _linear_from_raw(GGMLType(int(qt)), raw, n, k)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="*", default=["Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_0"])
    ap.add_argument("--n", type=int, default=4096, help="weight rows")
    ap.add_argument("--k", type=int, default=1536, help="weights per row (a multiple of 256 for K-quants)")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rows8", type=int, default=None,
                    help="ss_set_rows8 mask (bit 0 q4, 1 q8, 2 Q6_K and the per-16 planes, 3 Q5_K, 4 Q5_0/Q5_1, "
                         "5 the IQ4 layouts): which types take the 8-row kernels")
    args = ap.parse_args()

    from slipstream.kernels.cpu import load_library
    lib = load_library()
    if lib is None:
        print("native CPU kernels unavailable")
        return 1
    if args.rows8 is not None:
        lib.ss_set_rows8(args.rows8)
    print(f"rows8 mask {lib.ss_rows8()}; ISA {lib.ss_isa().decode()}; threads {lib.ss_parallel_threads()}; matrix {args.n} x {args.k}; "
          f"median of {args.repeats}")
    for name in args.types:
        lin = weight(name, args.n, args.k)
        mat = lin.ss_mat(with_bias=False)
        for rows in args.rows:
            x = torch.randn(rows, args.k, generator=torch.Generator().manual_seed(1))
            y = torch.empty(rows, lin.n)
            times = []
            for _ in range(args.repeats + 3):
                t = time.perf_counter()
                lib.ss_matmul(ctypes.byref(mat), rows, x.data_ptr(), y.data_ptr(), 0)
                times.append(time.perf_counter() - t)
            s = statistics.median(times[3:])
            print(f"{name:<6} rows {rows}: {s * 1e3:7.3f} ms  {rows * lin.n * lin.k / s / 1e9:7.1f} GMAC/s  "
                  f"{lin.nbytes / s / 1e9:6.1f} GB/s of weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
