"""Native CPU decode steps under variants of the step's task plan, timed alternately in one process.

The plan (`runtime/cpu_plan.py`) is built once per decoder and row count, so each variant gets its own
`CpuTeamDecoder`, built while `cpu_plan` is patched with the variant's settings; the decoders then run the
same step (`--batch` rows at a fixed position after `--context` cached tokens) in turns of 10 steps, so
slow drifts of a shared host fall on every variant alike. Prints each variant's median step time.

    python benchmarks/plan_ab.py --batch 8 --variants tasks=4 tasks=1          # tasks per thread and operator
    python benchmarks/plan_ab.py --batch 8 --variants whole=0 whole=1          # attention tasks per KV head / per row
    python benchmarks/plan_ab.py --batch 8 --variants split=8 split=4          # rows up to which attention gets parts
    python benchmarks/plan_ab.py --batch 8 --variants norm=8 norm=4            # rows per RMSNorm task (at most)
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable


def _patches(spec: str) -> dict[str, Any]:
    """'tasks=1,whole=0' -> the cpu_plan attributes to set while the variant's decoder is built."""
    from slipstream.runtime import cpu_plan
    out: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        if key == "tasks":
            out["TASKS_PER_THREAD"] = int(value)
        elif key == "whole":
            whole: Callable[[int, int], bool] = cpu_plan.attention_whole_rows
            on = value == "1"
            out["attention_whole_rows"] = lambda rows, threads, whole=whole, on=on: on and whole(rows, threads)
        elif key == "split":
            out["ATTN_SPLIT_ROWS"] = int(value)
        elif key == "norm":
            out["NORM_ROWS"] = int(value)
        else:
            raise SystemExit(f"unknown plan setting {key!r} (tasks=N, whole=0|1, split=N, norm=N)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--variants", nargs="+", default=["tasks=4", "tasks=1"],
                    help="comma-separated settings per variant: tasks=N (tasks per thread and product "
                         "operator), whole=0|1 (attention tasks take whole rows where the plan would), split=N "
                         "(ATTN_SPLIT_ROWS), norm=N (NORM_ROWS: rows per RMSNorm task at most)")
    args = ap.parse_args()

    from slipstream import LLM
    from slipstream.kv.blocks import SequenceKV
    from slipstream.runtime import cpu_plan
    from slipstream.runtime.cpu_team import CpuTeamDecoder
    from slipstream.step import decode_step, prefill_step

    llm = LLM(args.model, runtime="native", kv_cache_tokens=(args.context + 8) * args.batch + 64)
    model, kv = llm.model, llm.engine.kv
    seqs = [SequenceKV(kv) for _ in range(args.batch)]
    for i, s in enumerate(seqs):
        s.reserve(args.context + 4)
        model.forward(prefill_step(s, [1 + i] * args.context), kv)
    tokens, pos = [2] * args.batch, [args.context] * args.batch

    defaults = {name: getattr(cpu_plan, name) for name in ("TASKS_PER_THREAD", "attention_whole_rows")}
    decoders = {}
    for spec in args.variants:
        for name, value in (defaults | _patches(spec)).items():
            setattr(cpu_plan, name, value)
        dec = CpuTeamDecoder(model, kv, exact=False)
        for _ in range(3):   # the plan is built on the first step, with the patches in force
            dec.forward(decode_step(seqs, tokens, pos), tokens_only=True)
        decoders[spec] = dec
    for name, value in defaults.items():
        setattr(cpu_plan, name, value)

    times: dict[str, list[float]] = {spec: [] for spec in decoders}
    for _ in range(args.rounds):
        for spec, dec in decoders.items():
            for _ in range(10):
                t = time.perf_counter()
                dec.forward(decode_step(seqs, tokens, pos), tokens_only=True)
                times[spec].append(time.perf_counter() - t)
    base = statistics.median(times[args.variants[0]])
    for spec, ts in times.items():
        med = statistics.median(ts)
        print(f"{spec}: step median {med * 1e3:.2f} ms, {args.batch / med:.1f} tok/s, {med / base:.3f}x the first")


if __name__ == "__main__":
    main()
