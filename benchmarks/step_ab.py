"""Native CPU decode steps timed in-process, for A/B comparisons on a noisy host.

Decodes `--batch` rows at a fixed position (`--context` tokens already cached, the same step over and
over) with the native runtime's fast path and prints the median step time. With `--prefetch` values
the weight-prefetch distance (`ss_set_prefetch`, bytes) changes every `--per` steps, cycling through
the values, so slow drifts of the host hit every value alike. To compare two trees, run this file
alternately with PYTHONPATH pointing at each and compare the medians.

    python benchmarks/step_ab.py [--batch 1] [--context 100] [--rounds 15] [--prefetch 0 32768 65536]
    python benchmarks/step_ab.py --setting wait-prefetch --prefetch 0 65536    # prefetch while waiting
    python benchmarks/step_ab.py --prefill 64      # a 64-token prompt chunk on the native step instead
    python benchmarks/step_ab.py --batch 8 --setting amx --prefetch 0 1   # AMX tile products off / on
    python benchmarks/step_ab.py --batch 8 --setting twin --prefetch 0 1  # paired kernels / twin and tiles
    python benchmarks/step_ab.py --batch 8 --setting twin-rows --prefetch 9 2   # 8-row kernels / 512-bit twin
    python benchmarks/step_ab.py --model IQ4_XS.gguf --batch 8 --setting iq16-rows --prefetch 9 2
                                       # the IQ types' products 8 weight rows at a time / 16 from 2 rows on
    SLIPSTREAM_ADAPTIVE_THREADS=0 python benchmarks/step_ab.py --neighbour --setting wait-prefetch --prefetch 0 65536
                                       # beside a busy process, the team at its size throughout
    SLIPSTREAM_MARCH=x86-64-v3 python benchmarks/step_ab.py --batch 8 --setting rows8 --prefetch 0 1 3
                                       # AVX2 products one weight row at a time / q4 8 at a time / q4 and q8
    python benchmarks/step_ab.py --batch 8 --kv-cache-dtype fp32          # the KV cache's element type (run
                                                                          # alternately with fp16)
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per", type=int, default=10, help="timed steps per value and round")
    ap.add_argument("--prefetch", type=int, nargs="*", default=[], help="prefetch distances (bytes) to cycle")
    ap.add_argument("--prefill", type=int, default=0,
                    help="time a prompt chunk of this many tokens (after --context) instead of a decode step")
    settings = ["prefetch", "wait-prefetch", "attn-prefetch", "amx", "twin", "rows8", "twin-rows", "twin16",
                "iq16-rows"]
    ap.add_argument("--setting", choices=settings, default="prefetch",
                    help="what --prefetch's values set: the weight-prefetch distance (ss_set_prefetch), the "
                         "bytes a waiting task prefetches of its weights (ss_set_wait_prefetch), or the cache "
                         "rows attention prefetches ahead (ss_set_attn_prefetch), whether batched products run on AMX "
                         "tiles (ss_set_amx: 0 or 1), or whether q4/q8 products run on the twin and tiles or on the "
                         "paired kernels (ss_set_twin: 0 or 1), or whether the AVX2 q4 and q8 products take 8 "
                         "weight rows at a time or one (ss_set_rows8: bit 0 q4, bit 1 q8, bit 2 Q6_K, bit 3 Q5_K, "
                         "bit 4 Q5_0 and Q5_1 (off by default)), or from how many activation rows the AVX-512 VNNI "
                         "builds' q4/q8 products take the 512-bit twin instead of the 8-row kernels "
                         "(ss_set_twin_rows: 9 never), or from how many the IQ4 layouts' and per-16 IQ planes' "
                         "products take 16 weight rows at a time (ss_set_iq16_rows: 9 never), or whether that "
                         "twin has lanes = weight rows (ss_set_twin16: 0 "
                         "the reducing twin, 1)")
    ap.add_argument("--neighbour", action="store_true",
                    help="time the steps beside a busy neighbour process (cpu_decode.py's 2-thread matrix multiply); "
                         "SLIPSTREAM_ADAPTIVE_THREADS=0 keeps the team at its size beside it")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp16", "fp32", "int8"], default="auto",
                    help="the KV cache's element type (EngineConfig.kv_cache_dtype)")
    args = ap.parse_args()

    from slipstream import LLM
    from slipstream.kernels.cpu import load_library
    from slipstream.kv.blocks import SequenceKV
    from slipstream.runtime.cpu_team import CpuTeamDecoder
    from slipstream.step import decode_step, prefill_step

    lib = load_library()
    llm = LLM(args.model, runtime="native", kv_cache_tokens=(args.context + 8 + args.prefill) * args.batch + 64,
              kv_cache_dtype=args.kv_cache_dtype)
    model, kv = llm.model, llm.engine.kv
    dec = CpuTeamDecoder(model, kv, exact=False)
    seqs = [SequenceKV(kv) for _ in range(args.batch)]
    for i, s in enumerate(seqs):
        s.reserve(args.context + max(4, args.prefill))
        model.forward(prefill_step(s, [1 + i] * args.context), kv)
    tokens, pos = [2] * args.batch, [args.context] * args.batch

    chunk = prefill_step(seqs[0], [3 + i % 500 for i in range(args.prefill)], args.context) if args.prefill else None

    def step() -> float:
        t = time.perf_counter()
        dec.forward(chunk if chunk is not None else decode_step(seqs, tokens, pos), tokens_only=True)
        return time.perf_counter() - t

    neighbour = None
    if args.neighbour:
        from cpu_decode import start_neighbour  # this folder is on sys.path when this file runs
        neighbour = start_neighbour()
    for _ in range(5):
        step()
    values: list[int | None] = list(args.prefetch) or [None]
    times: dict[int | None, list[float]] = {v: [] for v in values}
    for _ in range(args.rounds):
        for v in values:
            if v is not None:
                {"prefetch": lib.ss_set_prefetch, "wait-prefetch": lib.ss_set_wait_prefetch,
                 "attn-prefetch": lib.ss_set_attn_prefetch, "amx": lib.ss_set_amx, "twin": lib.ss_set_twin,
                 "rows8": lib.ss_set_rows8, "twin-rows": lib.ss_set_twin_rows,
                 "twin16": lib.ss_set_twin16, "iq16-rows": lib.ss_set_iq16_rows}[args.setting](v)
            step()   # the first step after a change is not counted
            times[v] += [step() for _ in range(args.per)]
    if neighbour is not None:
        neighbour.kill()
        neighbour.wait()
    base = statistics.median(times[values[0]])
    for v in values:
        med = statistics.median(times[v])
        unitless = args.setting in ("amx", "twin", "rows8", "twin-rows", "twin16", "iq16-rows")
        label = "default" if v is None else f"{args.setting} {v}" + ("" if unitless else " B")
        print(f"{label}: step median {med * 1e3:.2f} ms, min {min(times[v]) * 1e3:.2f} ms, "
              f"{args.batch / med:.1f} tok/s, {med / base:.3f}x the first")


if __name__ == "__main__":
    main()
