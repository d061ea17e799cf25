"""Building the C kernels where the first try fails: a compiler that refuses -march=native (or OpenMP), a cache
folder that cannot be written. The library still loads, on the best ISA the compiler takes, with a warning."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.kernels.cpu import build

ROOT = Path(__file__).resolve().parents[2]

PROBE = ("import warnings; warnings.simplefilter('always')\n"
         "from slipstream.kernels.cpu import load_library as l\n"
         "lib = l(); print(lib.ss_isa().decode() if lib else 'none', lib.ss_parallel_probe() if lib else 0)\n")


def fake_compiler(tmp_path: Path, refuse: list[str]) -> Path:
    """gcc behind a script that logs every call and fails on any of `refuse`, as a compiler without that
    option (or without OpenMP's runtime) does. It builds at -O1 (appended: the last -O wins): these tests check
    which flags are tried and where the library lands, not the kernels' speed, and -O1 compiles step.c in about
    a third of -O3's time (17 s against ~45 s on the Sapphire Rapids Xeon)."""
    log = tmp_path / "calls.log"
    cc = tmp_path / "cc"
    cases = "".join(f"    {opt}) echo \"cc: error: unsupported option '{opt}'\" >&2; exit 1;;\n" for opt in refuse)
    cc.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\nfor a in \"$@\"; do case \"$a\" in\n{cases}"
                  f"  esac; done\nexec {shutil.which('gcc')} \"$@\" -O1\n")
    cc.chmod(0o755)
    return cc


def rungs(log: Path) -> list[str]:
    """The flags of each build try, in order, from the fake compiler's log: a try compiles every source to an object
    (several at once) and links them, so its calls differ only in the files they name."""
    tries: list[str] = []
    for call in log.read_text().splitlines():
        flags = " ".join(a for a in call.split() if a not in ("-c", "-o", "-lm") and not a.endswith((".c", ".o", ".so")))
        if flags not in tries:
            tries.append(flags)
    return tries


def probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


@pytest.mark.skipif(shutil.which("gcc") is None or not Path("/proc/cpuinfo").exists(), reason="needs gcc on Linux")
def test_a_compiler_refusing_native_builds_for_the_isa_the_cpu_names_in_a_temp_folder(tmp_path: Path):
    cc = fake_compiler(tmp_path, ["-march=native"])
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("SLIPSTREAM_MARCH", "SLIPSTREAM_NO_NATIVE")}
    env.update(CC=str(cc), SLIPSTREAM_CACHE=str(unwritable / "cache"), TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    run = probe(env)
    assert run.returncode == 0, run.stderr[-2000:]
    calls = rungs(tmp_path / "calls.log")
    assert "-march=native" in calls[0]                   # the CPU's own ISA first
    named = build._named_isa(build._cpu_id())
    isa, threads = run.stdout.split()
    if named is None:                                    # a CPU without AVX2: the compiler's default target
        assert len(calls) == 2 and "-march" not in calls[1]
    else:
        assert len(calls) == 2 and f"-march={named}" in calls[1] and "-fopenmp" in calls[1]
        assert isa != "portable"                          # vector kernels, not the scalar branch
    assert int(threads) >= 1
    assert "refused" in run.stderr and "-march=native" in run.stderr
    assert list((tmp_path / "tmp").glob("slipstream-*/kernels/slipstream_cpu_*.so"))   # the temp folder
    # the next process finds that build and does not ask the compiler again
    logged = len((tmp_path / "calls.log").read_text().splitlines())
    again = probe(env)
    assert again.returncode == 0 and again.stdout == run.stdout, again.stderr[-2000:]
    assert len((tmp_path / "calls.log").read_text().splitlines()) == logged


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_a_compiler_without_openmp_still_builds_the_kernels(tmp_path: Path):
    cc = fake_compiler(tmp_path, ["-fopenmp"])
    env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_NO_NATIVE"}
    env.update(CC=str(cc), SLIPSTREAM_CACHE=str(tmp_path / "cache"), SLIPSTREAM_MARCH="x86-64"
               if os.uname().machine == "x86_64" else "armv8-a")
    run = probe(env)
    assert run.returncode == 0, run.stderr[-2000:]
    calls = rungs(tmp_path / "calls.log")
    assert [("-fopenmp" in c) for c in calls] == [True, True, False]
    isa, threads = run.stdout.split()
    assert threads == "1"                                 # no OpenMP: the regions outside the step on one thread
    assert "refused" in run.stderr


def test_the_named_isa_follows_the_cpus_flags():
    v3 = "fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe abm"
    assert build._named_isa(f"flags\t: {v3}") == "x86-64-v3"
    assert build._named_isa(f"flags\t: {v3} avx512f avx512bw avx512cd avx512dq avx512vl") == "x86-64-v4"
    assert build._named_isa("flags\t: fpu sse2 avx") is None
    assert build._named_isa("flags\t: fpu sse2 avx avx2 fma f16c bmi1 bmi2") is None   # a VM hiding movbe, lzcnt
    assert build._named_isa("Features\t: fp asimd asimddp") == "armv8.2-a+dotprod"
    assert build._named_isa("Features\t: fp asimd") is None


class FakeBuilds:
    """build._compile and ctypes.CDLL stand-ins: a 'build' writes a file naming its flags, a 'load' returns the
    flags it was built with, and `refuse` lists options the fake compiler rejects."""

    def __init__(self, monkeypatch, refuse: tuple[str, ...] = ()):
        self.calls: list[list[str]] = []
        self.refuse = refuse
        monkeypatch.setattr(build, "_compile", self.compile)
        monkeypatch.setattr(build.ctypes, "CDLL", lambda path: Path(path).read_text())

    def compile(self, cc, flags, src, out):
        self.calls.append([*cc, *flags])
        if any(f in self.refuse for f in flags):
            return f"unsupported option {next(f for f in flags if f in self.refuse)}"
        out.write_text(" ".join(flags))
        return None


def test_a_fallback_build_is_never_taken_for_the_first_choice(monkeypatch, tmp_path):
    """A library built with flags that are a later step's (SLIPSTREAM_MARCH=x86-64-v3 here, or a build that
    fell back) is not loaded by a run whose first flags differ: that run tries its own first flags."""
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_cpu_id", lambda: "flags : avx2 fma f16c bmi1 bmi2 movbe abm")
    fake = FakeBuilds(monkeypatch)
    monkeypatch.setenv("SLIPSTREAM_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in build._build(["cc"])
    monkeypatch.delenv("SLIPSTREAM_MARCH")
    assert "-march=native" in build._build(["cc"])            # built anew, not the x86-64-v3 library
    assert len(fake.calls) == 2 and "-march=native" in fake.calls[1]
    # a compiler refusing -march=native: the named level, as a fallback, found again without a compile
    fake2 = FakeBuilds(monkeypatch, refuse=("-march=native",))
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "other"))
    with pytest.warns(UserWarning, match="refused"):
        assert "-march=x86-64-v3" in build._build(["cc"])
    with pytest.warns(UserWarning, match="refused"):
        assert "-march=x86-64-v3" in build._build(["cc"])
    assert len(fake2.calls) == 2


def test_without_openmp_the_isa_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    monkeypatch.delenv("SLIPSTREAM_MARCH", raising=False)
    fake = FakeBuilds(monkeypatch, refuse=("-fopenmp",))
    with pytest.warns(UserWarning, match="refused"):
        flags = build._build(["cc"])
    assert "-march=native" in flags and "-fopenmp" not in flags
    assert all("-fopenmp" in c for c in fake.calls[:-1])


def test_a_temp_folder_others_can_write_is_not_used(monkeypatch, tmp_path):
    """With the cache unwritable, the per-user temp folder is used only when it is private: a folder another
    user could write to (and plant a library in) is refused."""
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(unwritable / "cache"))
    monkeypatch.setattr(build.tempfile, "tempdir", str(tmp_path))
    FakeBuilds(monkeypatch)
    shared = tmp_path / f"slipstream-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.warns(UserWarning, match="no writable folder"):
        assert build._build(["cc"]) is None
    shared.chmod(0o700)
    assert build._build(["cc"]) is not None
    assert list(shared.glob("kernels/slipstream_cpu_*.so"))


def test_cc_may_hold_a_wrapper_and_its_arguments(monkeypatch):
    monkeypatch.setenv("CC", "ccache gcc")
    monkeypatch.delenv("SLIPSTREAM_NO_NATIVE", raising=False)
    asked: list[list[str]] = []
    monkeypatch.setattr(build, "_build", lambda cc: asked.append(cc))
    build.load_library.cache_clear()
    try:
        assert build.load_library() is None
    finally:
        build.load_library.cache_clear()   # the next caller builds (or finds) the real library
    assert asked == [["ccache", "gcc"]]
