"""Every launched Triton kernel of `slipstream/kernels/triton/`, compiled for Hopper (sm_90) by
Triton's ahead-of-time compiler, without a GPU.

The other kernel tests run under Triton's interpreter, which executes the Python body and so never
sees what only the real compiler rejects (if/else branches or loop-carried values whose types
differ, unsupported ops or dtypes, constexpr misuse, shared memory beyond the SM's). Here each
kernel goes through the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with ptxas).

How the signature is obtained: the real wrapper (`matvec`, `paged_decode_attention`, ...) is called
on "meta" tensors (dtype and shape, no storage) of the GPU path's dtypes (activations float32,
weights bf16 / int8 / uint8-packed int4, KV caches bf16, block tables and context lengths int32,
positions and write slots int64) at the benchmark shapes (dense-1B, dense-8B). The kernel the wrapper launches is swapped for a recorder that runs Triton's own
argument binder for a CUDA target (the same specialisation as a launch on a GPU: constexprs as the
wrapper derives them, ints equal to 1 folded, 16-divisibility hints) and compiles the result with
`triton.compiler.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`.

All cases compile in ONE subprocess (this file run as a script, `--worker`), whose environment has
no TRITON_INTERPRET (the interpreter replaces the JIT functions) and a fresh TRITON_CACHE_DIR (so
every run really compiles); it prints one JSON line per case. The module-scoped fixture runs it
once and the tests read its results. Skipped when the Triton build has no NVIDIA backend / ptxas.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL_MODULES = ("rope", "attention", "matvec", "sample")
ARCH = 90
SM90_MAX_SHARED = 232448     # bytes of shared memory one block may use on sm_90 (227 KiB)
MAX_SPILL = 64               # bytes of spill stack per thread: more means local-memory traffic in loops
BS = 16                      # KV-cache block size (the engine's default)

# the benchmark shapes (`slipstream.models.random_init.SHAPES`)
DENSE = {
    "1B": dict(hidden=2048, H=32, KVH=8, D=64, F=8192, V=128256),
    "8B": dict(hidden=4096, H=32, KVH=8, D=128, F=14336, V=128256),
}


@dataclass
class Case:
    name: str
    kernel: str                                   # "<module>.<kernel function>"
    launch: Callable[[], None]                    # calls the wrapper (in the worker) on meta tensors
    xfail: str | None = None                      # why the real compiler rejects it (documented)


CASES: dict[str, Case] = {}


SPILLS = {"matvec-bf16-8B-down-b8-acc-tune_max":   # known: the tuner would only ever find it slow
          "the largest tune candidate (64 x 256 tile, 8 rows) spills about 6.4 KB per thread"}


def _case(name: str, kernel: str, launch: Callable[[], None], xfail: str | None = None) -> None:
    assert name not in CASES, name
    CASES[name] = Case(name, kernel, launch, xfail or SPILLS.get(name))


# -- helpers used inside the worker ----------------------------------------------------------------
def _t(*shape, dtype: str = "float32"):
    """A meta tensor: dtype, shape and strides of a real one, no storage (data_ptr 0: aligned)."""
    import torch
    return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")


def _k(mod: str):
    import importlib
    return importlib.import_module(f"slipstream.kernels.triton.{mod}")


# -- rope + paged KV append -------------------------------------------------------------------------
def _rope(shape, B, qk_norm):
    s = DENSE[shape]
    H, KVH, D = s["H"], s["KVH"], s["D"]

    def launch():
        slots = 64 * BS
        kn = dict(q_norm=_t(D, dtype="bfloat16"), k_norm=_t(D, dtype="bfloat16")) if qk_norm else {}
        _k("rope").rope_kv_append(
            _t(B, (H + 2 * KVH) * D), _t(B, dtype="int64"), _t(D // 2), _t(B, dtype="int64"),
            _t(slots, KVH, D, dtype="bfloat16"), _t(slots, KVH, D, dtype="bfloat16"), H, KVH, D,
            q_out=_t(B, H, D), eps=1e-5, **kn)
    return launch


_case("rope-1B-b1", "rope._rope_kv_append_kernel", _rope("1B", 1, False))
_case("rope-8B-b8", "rope._rope_kv_append_kernel", _rope("8B", 8, False))
_case("rope-8B-b8-qk_norm", "rope._rope_kv_append_kernel", _rope("8B", 8, True))


# -- split-K paged decode attention (the graph runtime's call: partition 256, block_n 16) ----------
def _attention(shape, B, max_context):
    s = DENSE[shape]
    H, KVH, D = s["H"], s["KVH"], s["D"]

    def launch():
        slots = -(-max_context // BS) * BS
        splits = -(-max_context // 256)
        ws = (_t(B, H, splits, D), _t(B, H, splits), _t(B, H, splits))
        _k("attention").paged_decode_attention(
            _t(B, H, D), _t(slots, KVH, D, dtype="bfloat16"), _t(slots, KVH, D, dtype="bfloat16"),
            _t(B, -(-max_context // BS), dtype="int32"), _t(B, dtype="int32"), max_context,
            block_size=BS, partition=256, block_n=16, out=_t(B, H, D), workspace=ws)
    return launch


# 592: benchmarks/gpu_decode.py (512-token prompts + 64 steps, in 16-token blocks: 3 splits);
# 131072: the engine's default (max_model_len = max_position_embeddings: 512 splits)
for _shape, _B, _ctx in (("1B", 1, 592), ("8B", 4, 592), ("8B", 8, 131072)):
    for _kern in ("split", "reduce"):
        _case(f"attention-{_kern}-{_shape}-b{_B}-ctx{_ctx}",
              f"attention._paged_decode_{_kern}_kernel", _attention(_shape, _B, _ctx))


# -- matvec (dense bf16, int8 per group / per row, int4) and its split-K reduction ----------------
def _default_tile(n, k):
    """The graph runtime's untuned tile on the GPU: `configs.default_matvec` with CUDA reported
    available and 132 SMs (without the patch it returns the interpreter's tile, which a GPU never runs)."""
    from slipstream.kernels.triton.configs import default_matvec
    from slipstream.kernels.triton.offline import as_gpu
    with as_gpu(132):
        return default_matvec(n, k)


def _matvec(M, N, K, fmt, accumulate=False, tile=None, fused=False):
    """fused: the graph runtime's RMSNorm prologue, and SwiGLU when N is a gate/up weight (even)."""
    def launch():
        p = tile or _default_tile(N, K)
        if fmt == "bf16":
            w = (_t(N, K, dtype="bfloat16"),)
        elif fmt == "int8-g32":
            w = (_t(N, K, dtype="int8"), _t(N, K // 32))
        elif fmt == "int8-row":
            w = (_t(N, K, dtype="int8"), _t(N))
        else:   # int4: uint8 nibbles, per-32 scales and mins
            w = (_t(N, K // 2, dtype="uint8"), _t(N, K // 32), _t(N, K // 32))
        ws = _t(p["split_k"], M, N) if p["split_k"] > 1 else None
        if fused:
            glu = not accumulate
            _k("matvec").matvec(_t(M, K), *w, out=_t(M, N // 2 if glu else N), accumulate=accumulate,
                                workspace=ws, norm_weight=_t(K), eps=1e-5, glu=glu, **p)
            return
        _k("matvec").matvec(_t(M, K), *w, out=_t(M, N), accumulate=accumulate, workspace=ws, **p)
    return launch


_d1, _d8 = DENSE["1B"], DENSE["8B"]
_QKV1 = ((_d1["H"] + 2 * _d1["KVH"]) * _d1["D"], _d1["hidden"])
_QKV8 = ((_d8["H"] + 2 * _d8["KVH"]) * _d8["D"], _d8["hidden"])
_MATVECS = [   # name, M, N, K, fmt, accumulate, tile (None: the default heuristic)
    ("bf16-1B-qkv-b1", 1, *_QKV1, "bf16", False, None),                            # split 2
    ("bf16-1B-o-b8-acc", 8, _d1["hidden"], _d1["H"] * _d1["D"], "bf16", True, None),  # split 4
    ("bf16-8B-down-b8-acc", 8, _d8["hidden"], _d8["F"], "bf16", True, None),        # split 2
    ("bf16-1B-lm_head-b8", 8, _d1["V"], _d1["hidden"], "bf16", False, None),
    ("bf16-8B-qkv-b4", 4, *_QKV8, "bf16", False, None),
    ("bf16-8B-down-b8-acc-tune_max", 8, _d8["hidden"], _d8["F"], "bf16", True,      # largest
     dict(block_n=64, block_k=256, split_k=8, num_warps=4)),                       # tune candidate

    ("bf16-1B-gate_up-b1-eager_tile", 1, 2 * _d1["F"], _d1["hidden"], "bf16", False,   # an untuned tile
     dict(block_n=32, block_k=64, split_k=1, num_warps=4)),
    ("int8_g32-8B-gate_up-b8", 8, 2 * _d8["F"], _d8["hidden"], "int8-g32", False, None),
    ("int8_row-1B-o-b1-acc", 1, _d1["hidden"], _d1["H"] * _d1["D"], "int8-row", True, None),
    ("int4-8B-qkv-b8", 8, *_QKV8, "int4", False, None),
    ("int4-1B-down-b1-acc", 1, _d1["hidden"], _d1["F"], "int4", True, None),        # split 4
]
for _n, _M, _N, _K, _fmt, _acc, _tile in _MATVECS:
    _case(f"matvec-{_n}", "matvec._matvec_kernel", _matvec(_M, _N, _K, _fmt, _acc, _tile))
# the graph runtime's fused launches: norm + gate/up + SwiGLU (also through split-K), norm + QKV
for _n, _M, _N, _K, _fmt in [("bf16-1B-gate_up-b1", 1, 2 * _d1["F"], _d1["hidden"], "bf16"),
                             ("bf16-8B-gate_up-b8", 8, 2 * _d8["F"], _d8["hidden"], "bf16"),
                             ("int4-8B-gate_up-b1", 1, 2 * _d8["F"], _d8["hidden"], "int4")]:
    _case(f"matvec-fused-norm-swiglu-{_n}", "matvec._matvec_kernel", _matvec(_M, _N, _K, _fmt, fused=True))
_case("matvec-fused-norm-bf16-1B-qkv-b1-acc", "matvec._matvec_kernel", _matvec(1, *_QKV1, "bf16", True, fused=True))
# split-K reduces in the matvec kernel itself (the last program of a tile): the GPU tiles above
# (e.g. bf16-1B-o-b8-acc: split 4, int4-1B-down-b1-acc: split 4) compile that path
assert sum(_default_tile(n, k)["split_k"] > 1 for _, _, n, k, *_ in _MATVECS) >= 3


# -- token selection over the vocabulary ------------------------------------------------------------
def _greedy(B):
    return lambda: _k("sample").greedy(_t(B, DENSE["1B"]["V"]), out=_t(B, dtype="int64"))


_case("argmax-b8", "sample._argmax_kernel", _greedy(8))


# ==================================================================================================
# The worker: compiles every case (this file run as a script, in a subprocess without the interpreter)
# ==================================================================================================
class _Skip(Exception):
    pass


_TARGET: list = [None]   # (case name, kernel key) the recorders compile; the others do nothing
_RESULT: dict = {}


def _recorder(key: str, fn, backend, target):
    """Stands in for `fn` in its module: `fn[grid](*args, **kw)` binds the arguments as a launch on a
    CUDA device would (Triton's own binder for `target`) and compiles, without launching."""
    from triton import knobs
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, backend)

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if _TARGET[0] is None or _TARGET[0][1] != key:
                    return None
                kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
                bound, spec, opts = binder(*args, **kwargs)
                options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
                _RESULT["signature"] = {k: v for k, v in sig.items() if v != "constexpr"}
                _RESULT["constexprs"] = {fn.arg_names[p[0]]: v for p, v in constexprs.items()}
                ck = triton_compile(ASTSource(fn, sig, constexprs, attrs), target=target,
                                    options=options.__dict__)
                shared = int(ck.metadata.shared)
                _RESULT["shared"] = shared
                _RESULT["ptx_entry"] = f".entry {fn.__name__}" in ck.asm["ptx"]
                _RESULT["cubin_bytes"] = len(ck.asm["cubin"])
                ptx = ck.asm["ptx"]
                # 16-byte loads: plain vector loads, or the asynchronous 16-byte copies of the tensor-core
                # path (matvec of 2-16 rows), which Triton pipelines through shared memory
                cp16 = re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*\],\s*(?:16|0x10),", ptx)
                _RESULT["v4_loads"] = ptx.count("ld.global.v4") + ptx.count("ld.global.nc.v4") + len(cp16)
                from slipstream.runtime.megakernel import resource_usage
                _RESULT["spill"] = resource_usage(ck.asm["cubin"]).get("stack", 0)
                if shared > SM90_MAX_SHARED:
                    raise RuntimeError(f"needs {shared} bytes of shared memory, sm_90 allows "
                                       f"{SM90_MAX_SHARED} (launch would raise OutOfResources)")
                return None
            return launch

    return Recorder()


def _install(target) -> list[str]:
    """Replaces every @triton.jit kernel of the kernel modules by a recorder; returns their keys."""
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction

    backend = make_backend(target)
    keys = []
    for mod_name in KERNEL_MODULES:
        mod = _k(mod_name)
        for attr, obj in list(vars(mod).items()):
            # launched kernels only: helpers they call (`_load_w`, `_mv_tile`) must stay JIT functions
            if isinstance(obj, JITFunction) and attr.endswith("_kernel"):
                key = f"{mod_name}.{attr}"
                keys.append(key)
                setattr(mod, attr, _recorder(key, obj, backend, target))
    return keys


def _run_case(name: str) -> dict:
    """Compiles one case (in a pool process); MLIR / ptxas diagnostics on fd 2 go into the error."""
    import tempfile
    import traceback

    case = CASES[name]
    _TARGET[0] = (name, case.kernel)
    _RESULT.clear()
    t0 = time.perf_counter()
    ok, err = False, None
    with tempfile.TemporaryFile(mode="w+b") as cap:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(cap.fileno(), 2)
        try:
            from slipstream.kernels.triton.offline import as_gpu
            with as_gpu(132):    # the wrappers pick the GPU's tiles and split-K, not the interpreter's
                case.launch()
            if "shared" not in _RESULT:
                raise RuntimeError(f"the wrapper did not launch {case.kernel}")
            ok = _RESULT.get("ptx_entry", False)
            if not ok:
                err = f"no '.entry' for {case.kernel} in the PTX"
        except Exception as e:  # noqa: BLE001 - the compiler's error is the result
            tb = traceback.extract_tb(e.__traceback__)[-1]
            err = f"{type(e).__name__}: {e}\n(raised at {tb.filename}:{tb.lineno})"
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        cap.seek(0)
        diag = cap.read().decode(errors="replace")
    if not ok:
        diag = "\n".join(ln for ln in diag.splitlines() if "TRITON_DEFAULT_FP_FUSION" not in ln
                         and "warn_once(FP_FUSION" not in ln)
        if diag.strip():
            err = f"{err}\n--- compiler diagnostics ---\n{diag.strip()[-4000:]}"
    return dict(name=name, kernel=case.kernel, ok=ok, error=err,
                seconds=round(time.perf_counter() - t0, 2),
                **{k: _RESULT[k] for k in ("shared", "signature", "constexprs", "v4_loads", "spill")
                   if k in _RESULT})


def _worker(names: list[str]) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "the interpreter replaces JIT functions"
    t0 = time.perf_counter()
    try:
        import triton  # noqa: F401
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        if "nvidia" not in backends:
            raise _Skip("this Triton build has no NVIDIA backend")
        from triton.backends.nvidia.compiler import get_ptxas
        try:
            ptxas = get_ptxas(ARCH).path
        except Exception as e:  # noqa: BLE001
            raise _Skip(f"no ptxas for sm_{ARCH}: {e}")
        if not ptxas or not os.path.exists(ptxas):
            raise _Skip(f"no ptxas for sm_{ARCH}")
    except _Skip as e:
        print(json.dumps({"skip": str(e)}), flush=True)
        return
    except ImportError as e:
        print(json.dumps({"skip": f"triton not importable: {e}"}), flush=True)
        return
    import torch  # noqa: F401  (imported once, before the pool forks)
    keys = _install(GPUTarget("cuda", ARCH, 32))
    print(json.dumps({"kernels": keys}), flush=True)

    names = names or list(CASES)
    jobs = int(os.environ.get("SLIPSTREAM_COMPILE_JOBS", "0")) or min(len(names), os.cpu_count() or 1, 8)
    if jobs <= 1:
        for n in names:
            print(json.dumps(_run_case(n)), flush=True)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:
            futs = {pool.submit(_run_case, n): n for n in names}
            for f in as_completed(futs):
                try:
                    r = f.result()
                except Exception as e:  # noqa: BLE001 - a crashed worker (e.g. a compiler abort)
                    r = dict(name=futs[f], kernel=CASES[futs[f]].kernel, ok=False,
                             error=f"compile process died: {type(e).__name__}: {e}")
                print(json.dumps(r), flush=True)
    print(json.dumps({"total_seconds": round(time.perf_counter() - t0, 2)}), flush=True)


# ==================================================================================================
# The tests
# ==================================================================================================
TRITON36 = ROOT / "build" / "venv-triton36" / "bin" / "python"   # made by benchmarks/triton36_venv.sh


@pytest.fixture(scope="module", params=["installed", "triton-3.6"])
def compiled(request, tmp_path_factory) -> dict:
    """{"cases": {name: result}, "kernels": [...], "total_seconds": s} from one worker run: with the
    installed Triton, and with the GPU machine's Triton 3.6 when its venv exists (created by
    `bash benchmarks/triton36_venv.sh`; CI does not create it, so those cases skip with that reason)."""
    pytest.importorskip("triton")
    python = sys.executable
    if request.param == "triton-3.6":
        if not TRITON36.exists():
            pytest.skip(f"no Triton 3.6 venv at {TRITON36} (run `bash benchmarks/triton36_venv.sh`)")
        python = str(TRITON36)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton 3.9's default, without its warning
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([python, str(Path(__file__).resolve()), "--worker"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    res: dict = {"cases": {}, "kernels": None, "total_seconds": None}
    for line in out.stdout.splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        if "skip" in d:
            pytest.skip(f"cannot compile for sm_{ARCH} here: {d['skip']}")
        if "kernels" in d:
            res["kernels"] = d["kernels"]
        elif "total_seconds" in d:
            res["total_seconds"] = d["total_seconds"]
        else:
            res["cases"][d["name"]] = d
    if res["kernels"] is None or (out.returncode != 0 and len(res["cases"]) < len(CASES)):
        pytest.fail(f"compile worker failed (rc {out.returncode}):\n{out.stderr[-5000:]}")
    return res


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=c.xfail)) if c.xfail else n
    for n, c in CASES.items()])
def test_kernel_compiles_for_hopper(compiled, name):
    r = compiled["cases"].get(name)
    assert r is not None, "the worker reported nothing for this case (crashed?)"
    assert r["ok"], f"{CASES[name].kernel} does not compile for sm_{ARCH}:\n{r['error']}"
    assert r["shared"] <= SM90_MAX_SHARED
    assert r["spill"] <= MAX_SPILL, f"{r['spill']} bytes of spill stack"
    if CASES[name].kernel == "matvec._matvec_kernel" and "bf16" in name:
        # dense weights: 16-byte loads, vector or cp.async (the int8 / int4 paths still load narrower: issue 18)
        assert r["v4_loads"] >= 1, "no 16-byte global loads in a dense matvec"


def test_every_launched_kernel_is_covered(compiled):
    """Each @triton.jit kernel of the kernel modules has at least one case (a new kernel needs one)."""
    covered = {c.kernel for c in CASES.values()}
    assert set(compiled["kernels"]) == covered, (
        f"kernels without a case: {sorted(set(compiled['kernels']) - covered)}; "
        f"cases for unknown kernels: {sorted(covered - set(compiled['kernels']))}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    else:
        sys.exit("usage: test_hopper_compile.py --worker [case ...]  (or run it with pytest)")
