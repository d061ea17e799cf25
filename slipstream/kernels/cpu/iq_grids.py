"""The lattice types' grids (IQ1_S/M, IQ2_XXS/XS/S, IQ3_XXS/S) for the native decoders (iqtypes.h).

gguf-py holds them (decoded from its hex tables by `init_grid`); they are handed to each native library
once, before the first such matrix is used, so the C sources carry no copy. gguf is imported only then
(~0.13 s): files without these types never pay it.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

GRID_TYPES = {16, 17, 18, 19, 21, 22, 29}   # IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M
_lock = threading.Lock()
_done: set[int] = set()


def grids() -> list[np.ndarray]:
    """int8 [entries, values] for IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S (the order ss_set_iq_grids takes)."""
    import gguf.quants as q

    out = []
    for cls, shape in ((q.IQ2_XXS, (256, 8)), (q.IQ2_XS, (512, 8)), (q.IQ2_S, (1024, 8)), (q.IQ3_XXS, (256, 4)),
                       (q.IQ3_S, (512, 4)), (q.IQ1_S, (2048, 8))):
        cls.init_grid()
        g = np.asarray(cls.grid, dtype=np.float32).reshape(shape)
        v = g.astype(np.int8)
        if not np.array_equal(v.astype(np.float32), g):   # the decoders' codes are these integers
            raise ValueError(f"gguf's {cls.__name__} grid is not small integers")
        out.append(np.ascontiguousarray(v))
    return out


def install(lib: ctypes.CDLL | None) -> None:
    """Give `lib` the grids, once."""
    if lib is None or id(lib) in _done:
        return
    with _lock:
        if id(lib) in _done:
            return
        if not lib.ss_iq_grids_ready():
            tables = grids()
            lib.ss_set_iq_grids(*(t.ctypes.data for t in tables))
        _done.add(id(lib))
