"""The kernels on every instruction-set path, not only the one this machine's native build takes.

- x86-64: the library rebuilt for baseline x86-64 (portable C) and for x86-64-v3 (AVX2 + FMA), and
  the kernel tests rerun against each build in a child process; AVX-512 (x86-64-v4, with VNNI on
  Sapphire Rapids) is run where the CPU has it and at least compiled where it does not.
- Arm: simd_check.c (every row kernel against plain loops) cross-compiled with Debian's aarch64 gcc
  for plain NEON and for NEON with the dot-product extension, and run under qemu-user.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.kernels.cpu import native_available
from slipstream.kernels.cpu.build import SOURCES

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "slipstream" / "kernels" / "cpu"
X86 = platform.machine() in ("x86_64", "AMD64")
FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
KERNEL_TESTS = ["tests/kernels/test_cpu_simd.py", "tests/kernels/test_cpu_ops.py", "tests/kernels/test_cpu_qtypes.py", "tests/weights/test_quant.py",
                "tests/runtime/test_cpu_team.py::test_exact_matches_eager_on_packed_random_models"]


def _runs(march: str) -> bool:
    need = {"x86-64": [], "x86-64-v3": [" avx2 ", " fma "], "x86-64-v4": [" avx512f ", " avx512bw ", " avx512vl "]}
    return all(f in FLAGS for f in need[march])


@pytest.mark.skipif(not X86 or not native_available(), reason="needs an x86-64 C compiler")
@pytest.mark.parametrize("march,isa", [("x86-64", "portable"), ("x86-64-v3", "avx2"), ("x86-64-v4", "avx512")])
def test_x86_builds_pass_the_kernel_tests(march: str, isa: str):
    if not _runs(march):
        cc = shutil.which("gcc") or shutil.which("cc")
        for src in SOURCES:   # this CPU cannot run it: compile it
            proc = subprocess.run([cc, "-O2", f"-march={march}", "-std=gnu11", "-fopenmp", "-pthread", "-c",
                                   "-o", os.devnull, str(CPU / src)], capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr[-2000:]
        pytest.skip(f"this CPU cannot run {march} code (compiled it only)")
    env = {**os.environ, "SLIPSTREAM_MARCH": march}
    probe = subprocess.run([sys.executable, "-c", "from slipstream.kernels.cpu import load_library as l; "
                            "print(l().ss_isa().decode())"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert probe.stdout.strip().startswith(isa), probe.stdout + probe.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


ARM_CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


@pytest.mark.skipif(ARM_CC is None or QEMU is None,
                    reason="needs Debian's gcc-aarch64-linux-gnu and qemu-user (make test installs them when it can)")
@pytest.mark.parametrize("march,isa", [("armv8-a", "neon"), ("armv8.2-a+dotprod", "neon-dotprod")])
def test_arm_kernels_under_qemu(tmp_path: Path, march: str, isa: str):
    exe = tmp_path / "simd_check"
    build = subprocess.run([ARM_CC, "-O2", f"-march={march}", "-static", "-ffp-contract=off", "-o", str(exe),
                            str(ROOT / "tests" / "kernels" / "simd_check.c"), "-lm"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    # the whole library must build for Arm too (the step and its thread team)
    lib = subprocess.run([ARM_CC, "-O2", f"-march={march}", "-std=gnu11", "-fopenmp", "-pthread", "-shared", "-fPIC",
                          "-ffp-contract=off", "-o", str(tmp_path / "lib.so"),
                          *(str(CPU / s) for s in SOURCES), "-lm"],
                         capture_output=True, text=True)
    assert lib.returncode == 0, lib.stderr[-2000:]
    run = subprocess.run([QEMU, str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"{isa} ok", run.stdout + run.stderr


@pytest.mark.skipif(not X86 or not _runs("x86-64-v3"), reason="needs an x86-64 CPU with AVX2")
def test_x86_row_kernels_against_plain_loops(tmp_path: Path):
    """simd_check.c on this CPU at the AVX2 level: the x86 row kernels (the paired q4/q8 products
    included) against plain loops, as the Arm build is checked under qemu; the 8-weight-rows q4/q8 products
    bit for bit against a loop over their defined arithmetic."""
    cc = shutil.which("gcc") or shutil.which("cc")
    exe = tmp_path / "simd_check"
    build = subprocess.run([cc, "-O2", "-march=x86-64-v3", "-ffp-contract=off", "-o", str(exe),
                            str(ROOT / "tests" / "kernels" / "simd_check.c"), "-lm"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
