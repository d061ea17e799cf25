"""Registers, spill stack and vector loads of the megakernel for the benchmark shapes, with the plan
tiles the runtime builds on an H100 (`default_tiles` for 132 SMs), from Triton's offline compiler
(sm_90) and `cuobjdump -res-usage`: no GPU needed. A large spill stack or scalar
weight loads would cap the kernel's bandwidth before it ever runs on a GPU.

    python benchmarks/megakernel_resources.py [--context 512] [--num-warps 8]
"""
from __future__ import annotations

import argparse
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":   # the interpreter replaces the JIT functions
    sys.exit("run without TRITON_INTERPRET=1")

from slipstream.models.random_init import shape_config  # noqa: E402
from slipstream.runtime.megakernel import compile_offline, resource_usage  # noqa: E402
from slipstream.runtime.plan import WeightLayout, compile_plan, default_tiles  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--num-warps", type=int, default=8)
    a = ap.parse_args()
    print(f"| shape | batch | registers | spill stack (bytes) | 16-byte loads | 2-byte loads |  "
          f"(sm_90, {a.num_warps} warps, context {a.context}, default_tiles for 132 SMs)")
    print("|---|---|---|---|---|---|")
    for shape in ("dense-1B", "dense-8B"):
        cfg = shape_config(shape)
        for batch in (1, 4, 8):
            plan = compile_plan(cfg, batch, a.context, 16, WeightLayout.for_config(cfg, cfg.tie_word_embeddings),
                                default_tiles(cfg, a.context, 132))
            k = compile_offline(plan, num_warps=a.num_warps)
            use, ptx = resource_usage(k.asm["cubin"]), k.asm["ptx"]
            print(f"| {shape} | {batch} | {use['reg']} | {use['stack']} | {ptx.count('ld.global.v4')} | "
                  f"{ptx.count('ld.global.b16')} |")


if __name__ == "__main__":
    main()
