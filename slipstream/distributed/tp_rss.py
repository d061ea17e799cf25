"""Peak resident memory of each tensor-parallel rank (Linux: VmHWM of /proc/PID/status), after the
model is loaded and sharded and a few greedy tokens are generated:

    python -m slipstream.distributed.tp_rss [MODEL] --tensor-parallel 3 [--max-tokens 8]

`--tensor-parallel 1` measures the unsplit model on the eager step in one process. Prints one JSON
line: the model, N, each rank's peak RSS (VmHWM) and RSS after generating (VmRSS) in MiB, rank 0
first, and the greedy token ids.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any


def rss_mib(pid: int | None = None, field: str = "VmHWM") -> float:
    """A memory field of /proc/PID/status in MiB: VmHWM (peak resident set) or VmRSS (now)."""
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/PID/status (Linux only)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from slipstream.api import LLM, SamplingParams
    from slipstream.engine.config import EngineConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--tensor-parallel", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt", default="The capital of France is")
    a = ap.parse_args(argv)
    config = EngineConfig(runtime="eager", kv_cache_tokens=1024)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    if a.tensor_parallel == 1:
        llm = LLM(a.model, config=config)
        ids = llm.generate(a.prompt, params)[0].token_ids
        ranks = [(rss_mib(), rss_mib(field="VmRSS"))]
    else:
        from slipstream.distributed.tp_launch import tensor_parallel_llm

        llm, group = tensor_parallel_llm(a.model, config, a.tensor_parallel)
        try:
            ids = llm.generate(a.prompt, params)[0].token_ids
            pids = [os.getpid()] + [p.pid for p in group.processes]
            ranks = [(rss_mib(p), rss_mib(p, "VmRSS")) for p in pids]
        finally:
            group.close()
    out = {"model": a.model or "default", "tensor_parallel": a.tensor_parallel,
           "peak_rss_mib": [round(r[0], 1) for r in ranks], "rss_after_mib": [round(r[1], 1) for r in ranks],
           "token_ids": list(ids)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
