"""Compile and load the C kernels in this folder (cached by source, compiler and CPU)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first so the kernels share its OpenMP pool)

# the biggest first: each is compiled on its own core where there are cores for it (_compile)
SOURCES = ["step.c", "step_qt.c", "quant_matvec.c", "decode_ops.c"]
HEADERS = ["simd.h", "ops.h", "qtypes.h", "iqtypes.h", "amx.h", "step.h"]
# -ffp-contract=off: a*b+c stays two roundings unless a kernel asks for an FMA, so the kernels
# reproduce GGUF's and torch's element-wise maths exactly
# -fno-gcse -fno-gcse-after-reload: GCC's RTL global CSE passes cost a quarter of step.c's compile time (its row
# kernels are functions of hundreds of KB once every row count's variant is inlined) and the step no measurable
# speed: step.c 72.9 s against 108.6 s on the Zen 3 EPYC, the batch-1 step 3.92 against 3.97 ms, batch 8
# 14.40 against 14.29 ms (medians, alternating builds; docs/BENCHMARKS.md, 2026-12-02)
BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-gcse", "-fno-gcse-after-reload", "-shared", "-fPIC", "-std=gnu11",
              "-pthread"]


def _named_isa(flags: str) -> str | None:
    """The -march that names the vector extensions /proc/cpuinfo's `flags` (x86) or `Features` (Arm) list,
    for a compiler that does not take -march=native."""
    have = set(flags.split())
    v3 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}   # abm: lzcnt, as the kernel lists it
    if v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= have:
        return "x86-64-v4"
    if v3 <= have:
        return "x86-64-v3"
    if "asimddp" in have:
        return "armv8.2-a+dotprod"
    return None


def flag_ladder() -> list[list[str]]:
    """The flags to build with, best first. The CPU's own ISA (or SLIPSTREAM_MARCH); then, for a compiler that
    refuses -march=native, the ISA level the CPU's flags name (x86-64-v3 on an AVX2 CPU); then the compiler's
    default target (the kernels take the ISA it targets: NEON on every aarch64, the portable branch on plain
    x86-64); then each of those without OpenMP, for a compiler without its runtime (clang with no libomp): the
    step's own thread team does not need it, only the products outside the step run on one thread then."""
    named = _named_isa(_cpu_id()) if "SLIPSTREAM_MARCH" not in os.environ else None
    targets = [["-march=" + os.environ.get("SLIPSTREAM_MARCH", "native")], *([["-march=" + named]] if named else []), []]
    return [[*BASE_FLAGS, *t, *omp] for omp in (["-fopenmp"], []) for t in targets]


def _cpu_id() -> str:
    """The CPU's feature line: x86's `flags`, Arm's `Features`."""
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def cache_dir() -> Path:
    root = os.environ.get("SLIPSTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "slipstream")
    return Path(root) / "kernels"


def _writable(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(d, os.W_OK | os.X_OK)


def _private_temp_dir() -> Path | None:
    """A per-user folder under the temporary directory, for a cache that cannot be written (a read-only or
    missing home, as in a container started with --read-only): made 0700, and used only while it is this
    user's own and nobody else can write to it (another user could otherwise plant a library there)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    d = Path(tempfile.gettempdir()) / f"slipstream-{uid}"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.stat()
        if st.st_uid != uid or st.st_mode & 0o022:
            return None
        (d / "kernels").mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return None
    return d / "kernels"


def _cache_dirs() -> list[Path]:
    """Where a built library may be found, and the first of them where one may be put: the cache, or, when it
    cannot be written, the cache (it may hold a library already) then a private temp folder."""
    main = cache_dir()
    if _writable(main):
        return [main]
    temp = _private_temp_dir()
    return [main] + ([temp] if temp is not None else [])


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _compile(cc: list[str], flags: list[str], src: list[Path], out: Path) -> str | None:
    """Build `out` (atomically: concurrent processes never see a half-written file): each source to an object,
    as many at once as this process has cores (step.c and step_qt.c take most of the time, about as long each),
    then one link. The compiler's complaint on failure."""
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            objs = [Path(tmp) / f"{s.stem}.o" for s in src]
            with ThreadPoolExecutor(max_workers=min(_cores(), len(src))) as pool:
                runs = list(pool.map(lambda so: subprocess.run([*cc, *flags, "-c", str(so[0]), "-o", str(so[1])],
                                                               capture_output=True, text=True), zip(src, objs)))
            failed = next((r for r in runs if r.returncode != 0), None)
            if failed is None:
                tmp_out = Path(tmp) / out.name
                failed = subprocess.run([*cc, *flags, *map(str, objs), "-o", str(tmp_out), "-lm"],
                                        capture_output=True, text=True)
                if failed.returncode == 0:
                    os.replace(tmp_out, out)
                    return None
            return failed.stderr[-500:] or f"{cc[0]} exited with {failed.returncode}"
    except OSError as e:   # $CC names no program, the disk is full, ...
        return str(e)


def _build(cc: list[str]) -> ctypes.CDLL | None:
    """The library for this source, compiler and CPU: found in a cache folder, or built with the first flags
    of `flag_ladder` that compile (with a warning when those are not the first). A fallback build's name holds
    the first flags too, so it is found again only where those were refused, never where they are the ones
    asked for (SLIPSTREAM_MARCH) or where other first flags apply; once found, the first flags are not tried
    again (remove the cache folder to retry them, e.g. after installing an OpenMP runtime)."""
    here = Path(__file__).parent
    src = [here / s for s in SOURCES]
    digest = hashlib.sha256()
    for p in src + [here / h for h in HEADERS]:
        digest.update(p.read_bytes())
    ladder = flag_ladder()

    def name(rung: int) -> str:
        key = digest.copy()
        key.update(" ".join([*cc, *ladder[rung], _cpu_id()]).encode())
        if rung > 0:
            key.update((" after " + " ".join(ladder[0])).encode())
        return f"slipstream_cpu_{key.hexdigest()[:16]}.so"

    dirs = _cache_dirs()
    found = next(((i, d / name(i)) for i in range(len(ladder)) for d in dirs if (d / name(i)).exists()), None)
    complaint = ""
    if found is None:
        where = next((d for d in dirs if _writable(d)), None)
        if where is None:
            warnings.warn("native CPU kernels unavailable, using torch: no writable folder for them "
                          f"({', '.join(map(str, dirs))}; set SLIPSTREAM_CACHE)")
            return None
        # a first run in a terminal (`make chat`) would otherwise sit silent meanwhile (the build takes 52 s on the
        # 2-core Zen 3 EPYC, step.c and step_qt.c side by side; up to 4.6 minutes on a busy host)
        if sys.stderr.isatty():
            print("slipstream: building the native CPU kernels for this CPU, once: one to four minutes",
                  file=sys.stderr, flush=True)
        for i, flags in enumerate(ladder):
            failed = _compile(cc, flags, src, where / name(i))
            if failed is None:
                found = i, where / name(i)
                break
            complaint = complaint or failed
        else:
            warnings.warn(f"native CPU kernels unavailable, using torch: {complaint}")
            return None
    rung, path = found
    if rung > 0:
        warnings.warn(f"the native CPU kernels are built with `{' '.join(ladder[rung])}`: the compiler refused "
                      f"`{' '.join(ladder[0])}`, so they may run slower. {complaint}".rstrip())
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:   # e.g. a cache on a noexec mount
        warnings.warn(f"native CPU kernels unavailable, using torch: {e}")
        return None


@lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when no C compiler is available."""
    if os.environ.get("SLIPSTREAM_NO_NATIVE"):
        return None
    default_cc = shutil.which("gcc") or shutil.which("cc")
    cc = shlex.split(os.environ.get("CC", "")) or ([default_cc] if default_cc else [])   # CC may be "ccache gcc"
    if not cc:
        warnings.warn("no C compiler found (gcc or cc, or $CC): the native CPU kernels are off and "
                      "decoding runs on torch, several times slower")
        return None
    lib = _build(cc)
    if lib is None:
        return None
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    f32 = ctypes.c_float
    signatures = {
        "q4_matvec": [vp, i32, i32, vp, vp, vp, i32, vp, i32, vp],
        "q8_matvec": [vp, i32, i32, vp, vp, i32, vp, i32],
        "q4_dequant": [vp, vp, vp, i32, i32, vp],
        "q8_dequant": [vp, vp, i32, i32, vp],
        "rmsnorm": [vp, vp, i32, i32, f32, vp],
        "rope_store": [vp, i32, i32, i32, i32, vp, vp, vp, vp, f32, vp, vp, vp],
        "attn_decode": [vp, i32, i32, i32, i32, i32, vp, vp, vp, vp, f32, f32, vp],
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
        "ss_set_rows8": [i32],
        "ss_set_twin_rows": [i32],
        "ss_set_iq16_rows": [i32],
        "ss_set_twin16": [i32],
        "ss_rows8": [],
        "ss_set_wait_prefetch": [i32],
        "ss_set_attn_prefetch": [i32],
        "ss_qt_unpack": [i32, vp, i32, i32, i32, vp, vp, vp],
        "ss_qt_dequant": [i32, vp, i32, i32, i32, vp],
        "ss_qt_dequant_bf16": [i32, vp, i32, i32, i32, vp],
        "ss_add_rows": [vp, vp, ctypes.c_int64],
        "ss_set_iq_grids": [vp, vp, vp, vp, vp, vp],
        "ss_iq_grids_ready": [],
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
    lib.ss_set_rows8.restype = i32
    lib.ss_set_twin_rows.restype = i32
    lib.ss_set_iq16_rows.restype = i32
    lib.ss_set_twin16.restype = i32
    lib.ss_rows8.restype = i32
    lib.ss_iq_grids_ready.restype = i32
    lib.ss_isa.argtypes = []
    lib.ss_isa.restype = ctypes.c_char_p
    return lib


def native_available() -> bool:
    return load_library() is not None
