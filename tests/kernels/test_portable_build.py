"""The kernels' portable C path (CPUs without AVX-512) gives the same results as the references.

Builds the library for a baseline x86-64 target (no AVX-512, no FMA) and reruns the operator and
packed-product tests against it in a child process."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.kernels.cpu import native_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not native_available(),
                    reason="needs an x86-64 C compiler")
def test_portable_kernels_pass_the_kernel_tests():
    env = {**os.environ, "SLIPSTREAM_MARCH": "x86-64-v2"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/kernels/test_cpu_ops.py", "tests/weights/test_quant.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
