"""Time to the first token by prompt length, in process: where a model's prompt chunks run faster, on the native
step or on the eager BLAS step (`CpuTeamDecoder.prefill_tokens`, `eager_dense_from_rows`).

    python benchmarks/prompt_sizes.py --model F16.gguf                    # as the engine splits them
    python benchmarks/prompt_sizes.py --model F16.gguf --native-up-to 0   # every chunk eagerly (BLAS from 2 rows)
    python benchmarks/prompt_sizes.py --model F16.gguf --native-up-to 64  # up to 64 tokens on the native step
    python benchmarks/prompt_sizes.py --model F16.gguf --blas bf16        # the eager step in bf16 (else as chosen)

Each prompt is new token ids (no prefix shared with an earlier one); one generated token; the median of --runs
after a warm-up prompt of each length.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[2, 4, 8, 16, 24, 32, 64])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--native-up-to", type=int, default=None,
                    help="prompt tokens the native step takes (the rest eagerly, BLAS from the next row count on)")
    ap.add_argument("--blas", choices=["fp32", "bf16"], default=None,
                    help="how the eager step multiplies (the runtime's eager_blas; default: as the runtime chose)")
    args = ap.parse_args()

    from slipstream import LLM, SamplingParams
    from slipstream.weights import quant

    llm = LLM(args.model)
    rt = llm.engine.runtime
    if args.native_up_to is not None:
        rt.prefill_tokens = args.native_up_to
        rt.eager_dense_from_rows = max(2, args.native_up_to + 1)
    if args.blas is not None:
        rt.eager_blas = args.blas
    print(f"native step up to {getattr(rt, 'prefill_tokens', 0)} prompt tokens; eager BLAS from "
          f"{getattr(rt, 'eager_dense_from_rows', quant.DENSE_FROM_ROWS)} rows, in {getattr(rt, 'eager_blas', 'fp32')}")
    vocab = llm.model.cfg.vocab_size
    seed = 0
    for n in args.lengths:
        times = []
        for i in range(args.runs + 1):
            seed += 1
            ids = [100 + (seed * 7919 + j * 131) % (vocab - 200) for j in range(n)]
            t0 = time.perf_counter()
            llm.generate([ids], SamplingParams(max_tokens=1))
            if i:
                times.append(time.perf_counter() - t0)
        print(f"{n:5d} tokens: {statistics.median(times) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
