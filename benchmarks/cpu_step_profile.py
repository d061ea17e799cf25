"""Where the time of one CPU decode step goes: the native runtime's own per-opcode profile.

Runs decode steps of the native runtime (one native call per step, a persistent thread team running
the step's task table) over a context of `--context` tokens, the same step over and over at that position
(as step_ab.py does; `--grow` advances the position every step instead, so the context grows by `--steps`),
and reports:

* the median step time and tok/s (batch `--batch`), fast and exact paths;
* per opcode (QKV, attention, O, gate/up, down, LM head, ...): busy and waiting milliseconds per step
  summed over the team's threads, from timestamps the C executor takes around every task
  (`ss_profile`), and the tasks per step;
* the bytes of weights a step reads and the rate that implies.

    python benchmarks/cpu_step_profile.py [--model PATH] [--context 256] [--steps 60] [--batch 1] [--grow]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from slipstream.kv.blocks import SequenceKV
from slipstream.runtime import cpu_plan
from slipstream.step import decode_step, prefill_step

N_OPS = len(cpu_plan.OP_NAMES)   # step.c's profile slots, one per opcode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--grow", action="store_true",
                    help="advance the position every step (the context grows by --steps; the only mode "
                         "before 2026-12-04, so older figures span context .. context + steps)")
    args = ap.parse_args()

    from slipstream import LLM
    from slipstream.kernels.cpu import load_library
    from slipstream.runtime.cpu_team import CpuTeamDecoder

    lib = load_library()
    llm = LLM(args.model, runtime="native", kv_cache_tokens=(args.context + args.steps + 20) * args.batch + 64)
    model, kv = llm.model, llm.engine.kv
    weight_bytes = model.lm_head.nbytes + sum(w.nbytes for L in model.layers for w in L.linears())
    print(f"ISA: {lib.ss_isa().decode()}; batch {args.batch}; context {args.context}; "
          f"weights read per step {weight_bytes / 1e6:.1f} MB")
    for exact in (False, True):
        dec = CpuTeamDecoder(model, kv, exact=exact)
        seqs = [SequenceKV(kv) for _ in range(args.batch)]
        for i, s in enumerate(seqs):
            s.reserve(args.context + args.steps + 4)   # the warm-up steps too
            model.forward(prefill_step(s, [1 + i] * args.context), kv)
        tokens, pos = [2] * args.batch, [args.context] * args.batch
        times = []
        prof = np.zeros(3 * N_OPS, dtype=np.int64)
        for n in range(args.steps + 3):
            if n == 3:
                lib.ss_profile(1, None)
            t = time.perf_counter()
            tokens = dec.forward(decode_step(seqs, tokens, pos), tokens_only=True).tolist()
            if n >= 3:
                times.append(time.perf_counter() - t)
            if args.grow:
                pos = [p + 1 for p in pos]
        lib.ss_profile(0, prof.ctypes.data)
        for s in seqs:
            s.release()
        med = statistics.median(times)
        print(f"\n{'exact' if exact else 'fast'} path: step {med * 1e3:.2f} ms median "
              f"({args.batch / med:.1f} tok/s, {weight_bytes / med / 1e9:.1f} GB/s of weights), "
              f"min {min(times) * 1e3:.2f} ms")
        steps = len(times)
        print(f"  {'op':<9}{'busy ms/step':>13}{'wait ms/step':>13}{'tasks/step':>11}")
        for i, name in enumerate(cpu_plan.OP_NAMES):
            if prof[2 * N_OPS + i]:
                print(f"  {name:<9}{prof[i] / 1e6 / steps:>13.3f}{prof[N_OPS + i] / 1e6 / steps:>13.3f}"
                      f"{prof[2 * N_OPS + i] / steps:>11.0f}")


if __name__ == "__main__":
    main()
