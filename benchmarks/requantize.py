"""Re-quantize a GGUF with llama.cpp's own quantizer (`llama_model_quantize`, through llama-cpp-python),
into the file types people download: the inputs of the per-type table in docs/BENCHMARKS.md.

    python benchmarks/requantize.py                       # the default model into every type below
    python benchmarks/requantize.py --types Q4_K_M Q6_K --out /tmp/q

Prints one line per file: type, path, size. Files that already exist are kept. The default model is
itself Q4_1, so these files are quantized twice (fine for speed and for comparing engines on the same
file; not a quality study).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

TYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "Q5_0", "Q3_K_M"]


def default_model() -> str:
    from slipstream.weights import default_model_path
    return str(default_model_path())


def requantize(src: str, ftype_name: str, dst: Path) -> Path:
    import llama_cpp

    if dst.exists():
        return dst
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = dst.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(src.encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed for {ftype_name} (rc={rc})")
    tmp.replace(dst)
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="source GGUF (default: the embedded SmolLM2-135M)")
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--out", default=os.path.expanduser("~/.cache/slipstream/requantized"))
    a = ap.parse_args()
    src = a.model or default_model()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(src).stem
    for t in a.types:
        p = requantize(src, t, out / f"{stem}.{t}.gguf")
        print(f"{t}\t{p}\t{p.stat().st_size / 1e6:.1f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
