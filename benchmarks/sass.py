"""What the compiled code of a kernel does per loop iteration, read from its SASS.

`nvdisasm` (bundled with Triton's CUDA backend) disassembles a cubin with the source line of every
instruction (`-gi`). A loop is a backward branch; for every loop we count its instructions, barriers
(`BAR`), warp shuffles (`SHFL`), shared-memory traffic (`LDS`/`STS`), global loads by width
(`LDG.E.128` = 16 bytes; `LDGSTS...128`: 16-byte asynchronous copies to shared memory) and
atomics, and we note the Python source lines it came from. The GPU latency model (`gpu_model.py`)
turns these counts into time per iteration; the compile tests read the same counts to check that
no barrier or layout conversion sits inside a matvec K loop.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_INST = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Inst:
    addr: int
    opcode: str          # with modifiers, e.g. LDG.E.128.CONSTANT
    operands: str
    file: str
    line: int

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def load_bytes(self) -> int:
        """Bytes per thread of a global load (0 for other instructions)."""
        if self.base != "LDG":
            return 0
        mods = self.opcode.split(".")[1:]
        for m, n in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
            if m in mods:
                return n
        return 4


@dataclass
class Loop:
    start: int                     # index of the first instruction of the body
    end: int                       # index of the backward branch
    insts: list[Inst]
    innermost: bool = True
    counts: Counter = field(default_factory=Counter)

    @property
    def size(self) -> int:
        return len(self.insts)

    def lines(self) -> set[tuple[str, int]]:
        return {(Path(i.file).name, i.line) for i in self.insts}

    def summary(self) -> dict[str, int]:
        c = self.counts
        return {"instructions": self.size, "barriers": c["BAR"], "shuffles": c["SHFL"], "shared_ld": c["LDS"],
                "shared_st": c["STS"], "ldg": c["LDG"], "ldg16": c["LDG16"], "ldgsts16": c["LDGSTS16"],
                "ldg_bytes_per_thread": c["LDG_BYTES"],
                "atomics": c["ATOM"] + c["RED"] + c["ATOMG"]}


def nvdisasm_path() -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"


def disassemble(cubin: bytes) -> str:
    """SASS text with source lines (`nvdisasm -gi -c`)."""
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.cubin")
        Path(f).write_bytes(cubin)
        return subprocess.run([str(nvdisasm_path()), "-gi", "-c", f], capture_output=True, text=True,
                              check=True).stdout


def parse(sass: str) -> tuple[list[Inst], dict[str, int]]:
    """Instructions in address order and each label's instruction index."""
    insts: list[Inst] = []
    labels: dict[str, int] = {}
    file, line = "", 0
    for raw in sass.splitlines():
        s = raw.strip()
        m = _LINE.search(s)
        if m:
            file, line = m.group(1), int(m.group(2))
            continue
        m = _LABEL.match(s)
        if m:
            labels[m.group(1)] = len(insts)
            continue
        m = _INST.search(s)
        if m:
            insts.append(Inst(int(m.group(1), 16), m.group(3), m.group(4), file, line))
    return insts, labels


def _count(insts: list[Inst]) -> Counter:
    c: Counter = Counter()
    for i in insts:
        b = i.base
        c[b] += 1
        if b == "LDG":
            c["LDG_BYTES"] += i.load_bytes
            if i.load_bytes == 16:
                c["LDG16"] += 1
        elif b == "LDGSTS" and "128" in i.opcode.split("."):   # cp.async, 16 bytes (Triton's pipeliner)
            c["LDGSTS16"] += 1
    return c


def loops(sass: str) -> list[Loop]:
    """Every loop (backward branch) with its body's instruction counts, outermost first by start."""
    insts, labels = parse(sass)
    out = []
    for j, ins in enumerate(insts):
        if ins.base != "BRA":
            continue
        m = _TARGET.search(ins.operands)
        if not m or m.group(1) not in labels:
            continue
        k = labels[m.group(1)]
        if k <= j:
            body = insts[k:j + 1]
            out.append(Loop(k, j, body, counts=_count(body)))
    for a in out:
        a.innermost = not any(b is not a and a.start <= b.start and b.end <= a.end for b in out)
    return sorted(out, key=lambda lp: (lp.start, -lp.end))


def totals(sass: str) -> Counter:
    """Counts over the whole kernel."""
    return _count(parse(sass)[0])


__all__ = ["Inst", "Loop", "disassemble", "parse", "loops", "totals"]
