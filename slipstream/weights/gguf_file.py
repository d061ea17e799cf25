"""A GGUF file's header, read by us: its key/value metadata and its tensor records, each tensor a
view of one read-only memory map of the file.

gguf-py's `GGUFReader` wraps every element of every metadata array in numpy objects. For a 49k-token
vocabulary with its merges that took 2.7 s of SmolLM2-135M's 4 s load and 160 MB at its peak, and the
hundreds of thousands of small objects it left behind kept ~17 MB of Python's allocator arenas
resident after they were freed (an arena goes back to the OS only when all of it is free). Here a
metadata array is one Python list of plain values, and a tensor record is a `GGUFTensor` with the
fields of gguf-py's `ReaderTensor` that the loaders read (`name`, `tensor_type`, `shape`,
`n_elements`, `n_bytes`, `data_offset`, `data`), so code written against either takes both.

`read_metadata` reads the metadata only (the tokenizer's start-up); `GGUFFile` adds the tensors.
"""
from __future__ import annotations

import array
import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any, NamedTuple, overload

if TYPE_CHECKING:
    import numpy as np

class GGMLType(IntEnum):
    """ggml's tensor types, numbered as in ggml.h (and gguf-py's `GGMLQuantizationType`, with which
    they compare equal), so that loading a model needs no `gguf` package import (it pulls in
    sentencepiece and yaml: ~3 MB resident)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


# type -> (weights per block, bytes per block), as ggml's type traits
GGML_BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24), GGMLType.Q8_0: (32, 34), GGMLType.Q8_1: (32, 40),
    GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210), GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66), GGMLType.IQ2_XS: (256, 74), GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50), GGMLType.IQ4_NL: (32, 18), GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82), GGMLType.IQ4_XS: (256, 136), GGMLType.I8: (1, 1), GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4), GGMLType.I64: (1, 8), GGMLType.F64: (1, 8), GGMLType.IQ1_M: (256, 56),
    GGMLType.BF16: (1, 2), GGMLType.TQ1_0: (256, 54), GGMLType.TQ2_0: (256, 66), GGMLType.MXFP4: (32, 17),
}

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


class StringArray(Sequence[str]):
    """A GGUF array of strings (a vocabulary, its merges) kept as the file's bytes, one `bytes` copy,
    each item decoded when it is read. A list of 50k Python strings would be 50k small objects alive
    at once; whatever long-lived object is allocated among them keeps its 1 MB allocator arena
    resident after they are freed. Compares equal to a list or tuple of the same strings."""

    def __init__(self, blob: bytes, starts: array.array, endian: str) -> None:
        self._blob, self._starts = blob, starts       # starts[i]: where item i's 8-byte length is
        self._len = struct.Struct(endian + "Q")

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        off = self._starts[i]
        (n,) = self._len.unpack_from(self._blob, off)
        return str(self._blob[off + 8:off + 8 + n], "utf-8", "replace")

    def __iter__(self) -> Iterator[str]:
        blob, unpack = self._blob, self._len.unpack_from
        for off in self._starts:
            (n,) = unpack(blob, off)
            yield str(blob[off + 8:off + 8 + n], "utf-8", "replace")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (StringArray, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None   # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StringArray({len(self)} items)"


class _Header(NamedTuple):
    metadata: dict[str, Any]
    endian: str     # "<" or ">"
    n_tensors: int
    offset: int     # where the tensor records start


def _parse_metadata(buf: Any) -> _Header:
    """The header and key/value metadata of a GGUF file (v2/v3) in `buf` (bytes-like)."""
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    endian = "<"
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:  # the version reads byte-swapped: a big-endian file
        endian = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = struct.unpack_from(endian + "QQ", buf, 8)
    u64 = struct.Struct(endian + "Q")

    def read_str(off: int) -> tuple[str, int]:
        (n,) = u64.unpack_from(buf, off)
        off += 8
        return str(buf[off:off + n], "utf-8", "replace"), off + n

    def read_value(vtype: int, off: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return read_str(off)
        if vtype in _SCALAR:
            fmt = endian + _SCALAR[vtype]
            return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
        if vtype == _ARRAY:
            item_type, count = struct.unpack_from(endian + "IQ", buf, off)
            off += 12
            if item_type in _SCALAR:  # fixed-size items: one unpack for the whole array
                fmt = f"{endian}{count}{_SCALAR[item_type]}"
                return list(struct.unpack_from(fmt, buf, off)), off + struct.calcsize(fmt)
            if item_type == _STRING:  # the strings' bytes as they are, decoded when read
                start, starts = off, array.array("q", bytes(8 * count))
                for j in range(count):
                    starts[j] = off - start
                    off += 8 + u64.unpack_from(buf, off)[0]
                return StringArray(bytes(buf[start:off]), starts, endian), off
            items = []
            for _ in range(count):
                item, off = read_value(item_type, off)
                items.append(item)
            return items, off
        raise ValueError(f"unknown GGUF value type {vtype}")

    meta: dict[str, Any] = {}
    offset = 24
    for _ in range(n_kv):
        key, offset = read_str(offset)
        (vtype,) = struct.unpack_from(endian + "I", buf, offset)
        meta[key], offset = read_value(vtype, offset + 4)
    return _Header(meta, endian, int(n_tensors), offset)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (v2/v3), without touching the tensors."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse_metadata(buf).metadata
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)!r}: {e}") from None


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLType
    shape: tuple[int, ...]      # ggml order: shape[0] is the innermost (contiguous) dimension
    n_elements: int
    n_bytes: int
    data_offset: int            # in the file
    data: "np.ndarray"          # a read-only view of the map, typed and shaped as gguf-py's


class GGUFFile:
    """A GGUF file's metadata (`metadata`: key -> plain value or list) and tensors (`tensors`, in file
    order), the tensors' bytes in place in `data`, a read-only `np.memmap` of the whole file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import numpy as np

        QT = GGMLType
        self.path = os.fspath(path)
        self.data = np.memmap(self.path, mode="r")
        buf = memoryview(self.data)
        head = _parse_metadata(buf)
        self.metadata = head.metadata
        endian, off = head.endian, head.offset
        records = []
        for _ in range(head.n_tensors):
            (n,) = struct.unpack_from(endian + "Q", buf, off)
            name = str(buf[off + 8:off + 8 + n], "utf-8")
            off += 8 + n
            (n_dims,) = struct.unpack_from(endian + "I", buf, off)
            dims = struct.unpack_from(f"{endian}{n_dims}Q", buf, off + 4)
            off += 4 + 8 * n_dims
            ggml_type, rel = struct.unpack_from(endian + "IQ", buf, off)
            off += 12
            records.append((name, tuple(int(d) for d in dims), QT(ggml_type), int(rel)))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"invalid general.alignment {align!r}")
        self.alignment = align
        self.data_offset = -(-off // align) * align
        del buf
        dtypes = {QT.F16: np.float16, QT.F32: np.float32, QT.F64: np.float64, QT.I8: np.int8,
                  QT.I16: np.int16, QT.I32: np.int32, QT.I64: np.int64}
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, qt, rel in records:
            if name in seen:
                raise ValueError(f"duplicated tensor {name}")
            seen.add(name)
            n_elements = 1
            for d in dims:
                n_elements *= d
            block, type_size = GGML_BLOCK_SIZES[qt]
            n_bytes = n_elements * type_size // block
            start = self.data_offset + rel
            if start + n_bytes > self.data.size:
                raise ValueError(f"tensor {name} runs past the end of the file")
            np_dims = tuple(reversed(dims))
            if qt in dtypes:
                arr = self.data[start:start + n_bytes].view(np.dtype(dtypes[qt]).newbyteorder(endian))
            else:   # blocks: bytes, the last dimension in bytes per row (as gguf-py's reader gives them)
                arr = self.data[start:start + n_bytes]
                np_dims = (*np_dims[:-1], np_dims[-1] // block * type_size)
            self.tensors.append(GGUFTensor(name, qt, dims, n_elements, n_bytes, start, arr.reshape(np_dims)))
