"""Where the time of one CPU decode step goes (batch 1, the native runtime).

Times, as medians over many steps, the whole native decode step and its parts run on their own:
the packed matrix-vector products of the layers, the LM head, and everything else (norms, RoPE,
attention, SiLU, the step's Python) measured as the step with the products switched off.
Also reports the bytes of weights each step reads and the effective rate over them.

    python benchmarks/cpu_step_profile.py [--model PATH] [--context 256] [--steps 60]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from slipstream.kv.blocks import SequenceKV
from slipstream.step import prefill_step


def median_ms(fn: Callable[[], object], steps: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()

    from slipstream import LLM

    llm = LLM(args.model, runtime="native")
    model, rt = llm.model, llm.engine.runtime
    seq = SequenceKV(llm.engine.kv)
    seq.reserve(args.context + 1)
    pos = args.context

    def step() -> torch.Tensor:
        s = prefill_step(seq, [5], pos)
        return rt.forward(s)

    lib = rt.lib
    hid, F = model.cfg.hidden_size, model.cfg.intermediate_size
    x, xf = torch.randn(1, hid), torch.randn(1, F)
    scratch = torch.empty(F // 32 + 1)
    outs = {k: torch.empty(1, getattr(model.layers[0], k).n) for k in ("qkv", "o", "gate_up", "down")}
    logits = torch.empty(1, model.lm_head.n)

    def layer_products() -> None:
        for L in model.layers:
            for k in ("qkv", "o", "gate_up", "down"):
                src = xf if k == "down" else x
                getattr(L, k).native(lib, src.data_ptr(), 1, outs[k].data_ptr(), False, scratch.data_ptr())

    def lm_head() -> None:
        model.lm_head.native(lib, x.data_ptr(), 1, logits.data_ptr(), False, scratch.data_ptr())

    whole = median_ms(step, args.steps)
    prods = median_ms(layer_products, args.steps)
    head = median_ms(lm_head, args.steps)
    real = rt._matvec
    rt._matvec = lambda *a, **k: None
    rest = median_ms(step, args.steps)
    rt._matvec = real

    layer_bytes = sum(m.nbytes for L in model.layers for m in L.linears())
    print(f"model {llm.model_name}, context {args.context}, {torch.get_num_threads()} threads")
    print(f"{'part':34s} {'ms':>7s} {'share':>6s}")
    for name, ms in [("whole decode step", whole), ("layer products (packed matvec)", prods),
                     ("LM head (packed matvec)", head), ("everything else (step w/o products)", rest)]:
        print(f"{name:34s} {ms:7.2f} {ms / whole:6.0%}")
    print(f"layer weights {layer_bytes / 1e6:.1f} MB -> {layer_bytes / prods / 1e6:.1f} GB/s; "
          f"LM head {model.lm_head.nbytes / 1e6:.1f} MB -> {model.lm_head.nbytes / head / 1e6:.1f} GB/s; "
          f"step -> {1000 / whole:.1f} tok/s")


if __name__ == "__main__":
    main()
