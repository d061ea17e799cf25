"""Resident memory of serving a GGUF file, against the file's size: after `LLM` has loaded it, and after a
generation (the first steps build what the native step reads beside the weights: the tile-ordered scale
copies on AVX-512 VNNI machines, the KV cache). Each setting runs in a fresh process, so one's memory does not
carry into the next.

    python benchmarks/serving_memory.py --model <file.gguf> [--exact] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(model: str, exact: bool, max_tokens: int, kv_tokens: int) -> dict:
    import torch  # noqa: F401  (its own resident pages are not the model's: counted before)

    from slipstream import LLM, SamplingParams
    before = _rss()
    llm = LLM(model, exact=exact, kv_cache_tokens=kv_tokens)
    loaded = _rss()
    llm.generate("Write a short story about a lighthouse keeper.",
                 SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    served = _rss()
    size = os.path.getsize(model)
    return {"model": os.path.basename(model), "exact": exact, "file_mb": size / 1e6,
            "loaded_mb": (loaded - before) / 1e6, "served_mb": (served - before) / 1e6,
            "loaded_ratio": (loaded - before) / size, "served_ratio": (served - before) / size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--exact", action="store_true", help="the exact path too")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, default=1024, help="KV cache size (kept small: it is not the weights)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.model, a.exact, a.max_tokens, a.kv_tokens)))
        return
    rows = []
    for exact in ([False, True] if a.exact else [False]):
        cmd = [sys.executable, __file__, "--child", "--model", a.model, "--max-tokens", str(a.max_tokens),
               "--kv-tokens", str(a.kv_tokens)] + (["--exact"] if exact else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print("| file | path | file MB | loaded MB (x file) | after a generation MB (x file) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {'exact' if r['exact'] else 'fast'} | {r['file_mb']:.1f} | "
              f"{r['loaded_mb']:.1f} ({r['loaded_ratio']:.2f}x) | {r['served_mb']:.1f} ({r['served_ratio']:.2f}x) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
