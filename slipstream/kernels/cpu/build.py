"""Compile and load the C kernels in this folder (cached by source, compiler and CPU)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first so the kernels share its OpenMP pool)

SOURCES = ["quant_matvec.c", "decode_ops.c", "step.c"]
HEADERS = ["simd.h", "ops.h", "qtypes.h", "amx.h"]
# -ffp-contract=off: a*b+c stays two roundings unless a kernel asks for an FMA, so the kernels
# reproduce GGUF's and torch's element-wise maths exactly
FLAGS = ["-O3", "-march=" + os.environ.get("SLIPSTREAM_MARCH", "native"), "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-pthread"]


def _cpu_id() -> str:
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def cache_dir() -> Path:
    root = os.environ.get("SLIPSTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "slipstream")
    return Path(root) / "kernels"


@lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when no C compiler is available."""
    if os.environ.get("SLIPSTREAM_NO_NATIVE"):
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        warnings.warn("no C compiler found (gcc or cc, or $CC): the native CPU kernels are off and "
                      "decoding runs on torch, several times slower")
        return None
    here = Path(__file__).parent
    src = [here / s for s in SOURCES]
    key = hashlib.sha256()
    for p in src + [here / h for h in HEADERS]:
        key.update(p.read_bytes())
    key.update(" ".join([cc, *FLAGS, _cpu_id()]).encode())
    out = cache_dir() / f"slipstream_cpu_{key.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            res = subprocess.run([cc, *FLAGS, *map(str, src), "-o", str(tmp_out), "-lm"],
                                 capture_output=True, text=True)
            if res.returncode != 0:  # e.g. a CPU without AVX-512: the torch paths still work
                warnings.warn(f"native CPU kernels unavailable, using torch: {res.stderr[-500:]}")
                return None
            os.replace(tmp_out, out)  # atomic: concurrent processes never see a half-written file
    lib = ctypes.CDLL(str(out))
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    f32 = ctypes.c_float
    signatures = {
        "q4_matvec": [vp, i32, i32, vp, vp, vp, i32, vp, i32, vp],
        "q8_matvec": [vp, i32, i32, vp, vp, i32, vp, i32],
        "q4_dequant": [vp, vp, vp, i32, i32, vp],
        "q8_dequant": [vp, vp, i32, i32, vp],
        "rmsnorm": [vp, vp, i32, i32, f32, vp],
        "rope_store": [vp, i32, i32, i32, i32, vp, vp, vp, vp, f32, vp, vp, vp],
        "attn_decode": [vp, i32, i32, i32, i32, i32, vp, vp, vp, vp, f32, vp],
        "silu_mul": [vp, i32, i32, vp],
        "gelu_tanh_mul": [vp, i32, i32, vp],
        "ss_team_configure": [i32, i32, i32],
        "ss_parallel_probe": [],
        "ss_step": [vp, vp, vp, i32, vp, i32, i32],
        "ss_matmul": [vp, i32, vp, vp, i32],
        "ss_quantize": [vp, i32, i32, vp, vp, vp],
        "ss_profile": [i32, vp],
        "ss_set_prefetch": [i32],
        "ss_set_amx": [i32],
        "ss_amx_active": [],
        "ss_tile_planes": [],
        "ss_set_twin": [i32],
        "ss_set_wait_prefetch": [i32],
        "ss_set_attn_prefetch": [i32],
        "ss_qt_unpack": [i32, vp, i32, i32, i32, vp, vp, vp],
        "ss_qt_dequant": [i32, vp, i32, i32, i32, vp],
        "ss_qt_dequant_bf16": [i32, vp, i32, i32, i32, vp],
        "ss_add_rows": [vp, vp, ctypes.c_int64],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = None
    lib.ss_team_configure.restype = i32
    lib.ss_parallel_probe.restype = i32
    lib.ss_set_amx.restype = i32
    lib.ss_amx_active.restype = i32
    lib.ss_tile_planes.restype = i32
    lib.ss_set_twin.restype = i32
    lib.ss_isa.argtypes = []
    lib.ss_isa.restype = ctypes.c_char_p
    return lib


def native_available() -> bool:
    return load_library() is not None
