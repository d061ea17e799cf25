"""Host (Python) time per decoded token at batch 1, outside the native CPU step.

Loads the model as `slipstream generate` does (`LLM(model)`, the default GGUF when none is given),
streams `--max-tokens` greedy tokens with end-of-sequence ignored through `LLM.stream` (the engine
path the CLI and the server use) and times, over the decode phase (first token to last):

* wall:   per-token wall time between the first and the last streamed token;
* native: per-token time inside the native step call (`ss_step`, timed by a proxy around the
          runtime's ctypes library, in this script only);
* host:   wall - native, the Python work of the engine around each step.

Prints the median over `--runs` runs (after one warm-up). With `--profile FILE` it then runs the
generation once more under cProfile and prints the top functions by own time. To compare two trees,
run this file alternately with PYTHONPATH pointing at each.

    python benchmarks/host_overhead.py [--max-tokens 128] [--runs 3] [--profile /tmp/host.prof] [--batch 8]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any


class _TimedLib:
    """The runtime's ctypes library with `ss_step` timed; everything else passed through."""

    def __init__(self, lib: Any):
        self._lib = lib
        self.native_s = 0.0

    def ss_step(self, *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return self._lib.ss_step(*args)
        finally:
            self.native_s += time.perf_counter() - t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)


def _run(llm: Any, prompt: list[int], params: Any, timed: _TimedLib) -> tuple[float, float, int]:
    """(decode wall s, native s during decode, decode tokens) of one streamed generation."""
    first = last = None
    native0 = 0.0
    n = 0
    for chunk in llm.stream(prompt, params):
        now = time.perf_counter()
        if not chunk.token_ids:
            continue
        if first is None:
            first, native0 = now, timed.native_s
        else:
            n += len(chunk.token_ids)
        last = now
    assert first is not None and last is not None
    return last - first, timed.native_s - native0, n


def _batched(llm: Any, prompt: list[int], params: Any, timed: _TimedLib, batch: int, runs: int) -> None:
    """Per step of `batch` sequences generated together: wall, native and host time (medians of `runs`)."""
    prompts = [[prompt[0] + i, *prompt[1:]] for i in range(batch)]   # distinct: no request merging
    llm.generate(prompts, params)   # warm-up
    rows = []
    for i in range(runs):
        native0, t = timed.native_s, time.perf_counter()
        llm.generate(prompts, params)
        wall, native = time.perf_counter() - t, timed.native_s - native0
        steps = params.max_tokens
        rows.append((wall / steps, native / steps))
        print(f"run {i}: {steps} steps of {batch} rows, wall {wall / steps * 1e3:.3f} ms/step, "
              f"native {native / steps * 1e3:.3f}, host {(wall - native) / steps * 1e3:.3f}")
    print(f"median of {runs}: wall {statistics.median(r[0] for r in rows) * 1e3:.3f} ms/step, host "
          f"{statistics.median(r[0] - r[1] for r in rows) * 1e3:.3f} ms/step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF or model directory (default: the embedded model)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", default=None, help="write a cProfile of one more run here and print its top")
    ap.add_argument("--batch", type=int, default=1,
                    help="decode this many sequences together instead (`LLM.generate`; times per step, the "
                         "prompts' prefill included, so run enough tokens that decode dominates)")
    args = ap.parse_args()

    from slipstream import LLM, SamplingParams

    llm = LLM(args.model)
    runtime = llm.engine.runtime
    if not hasattr(runtime, "lib"):
        raise SystemExit(f"the runtime is {runtime.name!r}, not the native CPU step")
    timed = _TimedLib(runtime.lib)
    runtime.lib = timed
    prompt = (llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20))[:args.prompt_tokens]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    if args.batch > 1:
        _batched(llm, prompt, params, timed, args.batch, args.runs)
        return

    _run(llm, prompt, params, timed)   # warm-up: task tables, buffers, caches
    rows = []
    tokens: list[int] | None = None
    for i in range(args.runs):
        wall, native, n = _run(llm, prompt, params, timed)
        rows.append((wall / n, native / n))
        print(f"run {i}: {n} tokens, wall {wall / n * 1e3:.3f} ms/tok, native {native / n * 1e3:.3f}, "
              f"host {(wall - native) / n * 1e3:.3f}")
    out = llm.generate(prompt, params)[0].token_ids
    tokens = out
    wall = statistics.median(r[0] for r in rows)
    native = statistics.median(r[1] for r in rows)
    host = statistics.median(r[0] - r[1] for r in rows)
    print(f"median of {args.runs}: wall {wall * 1e3:.3f} ms/tok, native {native * 1e3:.3f} ms/tok, "
          f"host {host * 1e3:.3f} ms/tok ({1 / wall:.1f} tok/s)")
    print(f"tokens hash {hash(tuple(tokens)) & 0xffffffff:08x} (first {tokens[:8]})")

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        _run(llm, prompt, params, timed)
        prof.disable()
        prof.dump_stats(args.profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
