"""Native decode step with long-context attention in parts shared by the team, against one task per
(row, KV head) (the same kernels; `cpu_plan.attention_parts` forced to 1), alternating every 5 steps in
one process so drift on a shared machine falls on both alike.

    python benchmarks/attention_parts.py --context 1024 [--batch 1] [--rounds 24]

Run it at real-time priority on a busy host (`chrt -f 10`, as docs/BENCHMARKS.md did) or on a quiet one.
"""
from __future__ import annotations

import argparse
import statistics
import time

from slipstream import LLM
from slipstream.kv.blocks import SequenceKV
from slipstream.runtime import cpu_plan
from slipstream.runtime.cpu_team import CpuTeamDecoder
from slipstream.step import decode_step, prefill_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=24)
    a = ap.parse_args()
    steps = a.rounds * 2 * 5
    llm = LLM(None, runtime="native", kv_cache_tokens=(a.context + steps + 20) * a.batch + 64)
    model, kv = llm.model, llm.engine.kv
    decoders = {"parts": CpuTeamDecoder(model, kv), "one task": CpuTeamDecoder(model, kv)}
    seqs = [SequenceKV(kv) for _ in range(a.batch)]
    for i, s in enumerate(seqs):
        s.reserve(a.context + steps + 4)
        model.forward(prefill_step(s, [(1 + i + 7 * k) % 40000 + 5 for k in range(a.context)]), kv)
    tokens, pos = [2] * a.batch, [a.context] * a.batch
    shared = cpu_plan.attention_parts
    times: dict[str, list[float]] = {k: [] for k in decoders}
    for _ in range(a.rounds):
        for name, dec in decoders.items():
            # each decoder caches its plans: the override only matters when a plan is first built
            cpu_plan.attention_parts = shared if name == "parts" else (lambda *args: 1)
            for k in range(5):
                t = time.perf_counter()
                dec.forward(decode_step(seqs, tokens, pos), tokens_only=True)
                if k:   # the first step after a switch warms the other plan's caches
                    times[name].append(time.perf_counter() - t)
                pos = [p + 1 for p in pos]
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"context {a.context}, batch {a.batch}: parts {med['parts']:.2f} ms, one task per (row, KV head) "
          f"{med['one task']:.2f} ms per step: {med['one task'] / med['parts']:.3f}x")


if __name__ == "__main__":
    main()
