"""The Triton kernels as a GPU would launch them, recorded and compiled without a GPU.

`record(body)` runs `body` (a wrapper call, or a runtime's whole step over "meta" tensors) with
every launched `*_kernel` of the kernel modules replaced by a recorder: each `kernel[grid](...)`
becomes a `Launch` (kernel, grid, arguments) instead of running. `as_gpu(sms)` makes the wrappers
and `configs.default_matvec` see a CUDA device with `sms` SMs, so they pick the GPU's tiles and
split-K, not the interpreter's. `compile_launch` binds a launch's arguments the way a CUDA launch
would (Triton's own binder: constexprs, ints equal to 1 folded, 16-divisibility hints) and compiles
it for sm_90a with Triton's offline compiler (ptxas included). Needs no TRITON_INTERPRET in the
process (the interpreter replaces JIT functions).
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator
from unittest import mock

KERNEL_MODULES = ("rope", "attention", "matvec", "sample")
ARCH = 90


@dataclass
class Launch:
    """One recorded kernel launch."""
    kernel: str                     # "<module>.<function>"
    fn: Any                         # the JITFunction
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any]
    programs: int = field(init=False)

    def __post_init__(self) -> None:
        n = 1
        for g in self.grid:
            n *= int(g)
        self.programs = n


def _module(name: str):
    return importlib.import_module(f"slipstream.kernels.triton.{name}")


class _Recorder:
    def __init__(self, key: str, fn: Any, out: list[Launch]):
        self.key, self.fn, self.out = key, fn, out

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            g = grid(kwargs) if callable(grid) else grid
            g = tuple(int(v) for v in (g if isinstance(g, (tuple, list)) else (g,)))
            self.out.append(Launch(self.key, self.fn, g, args, dict(kwargs)))
        return launch


@contextlib.contextmanager
def record() -> Iterator[list[Launch]]:
    """Inside the block, kernel launches are recorded (in order) into the yielded list, not run (also
    under TRITON_INTERPRET=1, where the kernels are interpreted functions: counting works, compiling
    a recorded launch needs a process without the interpreter)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    out: list[Launch] = []
    saved: list[tuple[Any, str, Any]] = []
    try:
        for mod_name in KERNEL_MODULES:
            mod = _module(mod_name)
            for attr, obj in list(vars(mod).items()):
                if isinstance(obj, (JITFunction, InterpretedFunction)) and attr.endswith("_kernel"):
                    saved.append((mod, attr, obj))
                    setattr(mod, attr, _Recorder(f"{mod_name}.{attr}", obj, out))
        yield out
    finally:
        for mod, attr, obj in saved:
            setattr(mod, attr, obj)


@contextlib.contextmanager
def as_gpu(sms: int = 132) -> Iterator[None]:
    """`torch.cuda.is_available()` is True and device 0 has `sms` SMs (nothing else of CUDA works)."""
    props = SimpleNamespace(multi_processor_count=sms, name="modelled H100")
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.get_device_properties", return_value=props):
        yield


def compile_launch(launch: Launch, arch: int = ARCH, options: dict[str, Any] | None = None):
    """The CompiledKernel (`.asm` holds ttgir, ptx, cubin; `.metadata`) of a recorded launch for
    CUDA `arch`, specialised as a launch on that device would be."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile

    fn = launch.fn
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    binder = _binder(fn, backend)
    bound, spec, opts = binder(*launch.args, **kwargs)
    opts_, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    merged = {**opts_.__dict__, **(options or {})}
    return triton_compile(ASTSource(fn, sig, constexprs, attrs), target=target, options=merged)


def _binder(fn: Any, backend: Any) -> Callable:
    """Triton's argument binder for a CUDA backend (the function moved between 3.6 and 3.9)."""
    from triton.runtime import jit

    make = getattr(jit, "create_function_from_signature", None)
    if make is not None:
        return make(fn.signature, fn.params, backend)
    return fn.create_binder(backend)   # pragma: no cover - newer layouts


__all__ = ["Launch", "record", "as_gpu", "compile_launch", "KERNEL_MODULES"]
