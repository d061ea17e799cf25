"""A latency model of one decode step on an H100, for the graph and megakernel runtimes, without a GPU.

Every figure this prints is MODELLED, not measured. It exists because GPU time is rare for this
project: it turns what the compiled code does (read from sm_90a SASS that Triton's offline compiler
produces here) and what a step must do (the megakernel's task plan, the graph's recorded launches)
into a step time, so that kernel changes can be compared before a GPU confirms them. When a GPU is
lent, run `benchmarks/gpu_session.sh` and correct the assumptions below from the measured figures.

    python benchmarks/gpu_model.py                                   # dense-1B, dense-8B x batch 1/4/8
    python benchmarks/gpu_model.py --shape dense-1B --batch 1 --json # ends with one JSON line

What is read from the compiled code (per kernel, `benchmarks/sass.py`): every loop's instructions
per iteration, barriers, shuffles, global loads and their width, whether the loop's loads are used in
the iteration that issues them (one chunk in flight) or carried to the next (two in flight); for
loops Triton's pipeliner turned into asynchronous copies (LDGSTS, cp.async: the tensor-core paths),
the depth of their waits (`DEPBAR.LE SB0, N`: N + 1 chunks in flight; bytes per step then come from
the plan's K-chunk); local-memory (spill) loads and stores per loop; each branch's code outside its
innermost loops; the megakernel's spin loop (with PREFETCH=1 it reads an O-tile chunk per poll); the
megakernel's registers and spill stack (`cuobjdump -res-usage`). What comes from the plan/launches:
tasks (opcode, tile, wait and signal events) and bytes per task; programs and grids per launch;
from the kernel's constants, whether it draws tickets one task ahead (`TICKET_AHEAD`).

The model
---------
A loop iteration takes max(issue, bytes / per-SM bandwidth, (latency + issue) / chunks in flight),
issue = instructions x warps / 4 schedulers + 30 cycles per barrier. Megakernel: programs take
tasks in ticket order (the earliest free program gets the next ticket); a task starts when its
program is free and its wait event has its count (signal + poll latency after the last producer);
it costs a ticket atomic, the task-row load, one poll, a release signal, then its loops (with
tickets drawn ahead, a program's later tasks wait for their ticket only while its atomic, issued
when the previous task began, is still in flight; with `ROW_AHEAD` the next row is loaded as a
task's signal begins). With PREFETCH=1 a waiting O_PROJ task spins at the compiled chunk spin
loop's rate (a chunk read and a poll per spin) until its tile is read, then polls as every other
wait; it proceeds at the end of the first chunk spin begun once its event was visible (or a poll
after it), and runs the chunks it read at L2 latency and bandwidth. Each
phase's tasks share HBM bandwidth equally (bandwidth / min(tasks of the phase, SMs)). Graph:
per launch, the launch cost plus waves of programs (occupancy from registers and shared memory).
Both are floored at the step's bytes / copy bandwidth. Roofline: the step's weight + KV bytes /
copy bandwidth (the same definition as `gpu_decode.py`).

Assumptions (H100 SXM5 80 GB) and their sources
----------------------------------------------
- 132 SMs, 4 warp schedulers per SM issuing one instruction per cycle, 1.755 GHz under load
  (NVIDIA H100 Tensor Core GPU whitepaper / datasheet: 132 SMs, boost 1.98 GHz; 1.755 GHz assumed
  sustained).
- HBM3 3.35 TB/s peak (datasheet); copy bandwidth 3.0 TB/s assumed for the roofline until
  gpu_decode.py measures it (about 90% of peak, what large device copies reach on H100).
- Load-to-use latency: HBM 600 ns, L2 hit 270 ns (Chips and Cheese, "Nvidia's H100: Funny L2, and
  Tons of Bandwidth", pointer-chasing on H100 PCIe, rounded up for a loaded GPU).
- One SM moves at most 64 bytes per cycle from L2 (half its 128 B/cycle L1).
- Atomics and the release fence: one L2 round trip each (400 ns), the task row an L2 hit.
- Kernel launch inside a CUDA graph: 1.3 us per kernel (Hazy Research, "Look Ma, No Bubbles!",
  2025: measured on an H100 with CUDA graphs).
- A barrier (bar.sync) costs 30 cycles beyond its issue; every local-memory load or store (LDL/STL:
  spilled registers) inside a loop's body costs one L1 round trip (35 cycles) per iteration. Read per
  loop from the SASS: the kernel's stack size alone says nothing about where it is used (at dense-1B
  the megakernel's 32-byte stack is libdevice's sin/cos argument reduction for huge angles, a branch
  outside every matvec/attention loop; until 2026-11-24 the model charged 8 round trips per iteration
  of every loop for it).
- Each opcode's code outside its innermost loops (set-up, reductions after a loop, stores: read per
  branch from the SASS line info) is charged at its issue rate once per task (per batch row for the
  attention and argmax branches, which loop over rows); its load latencies are not. The graph
  path's kernels likewise: each program's code outside its innermost loops, once per program (both
  added 2026-11-24: before, code moved out of a loop looked free). Code on rarely taken paths
  (libdevice's sin/cos reduction of huge angles in the QKV/RoPE branch) is charged too.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":   # the interpreter replaces the JIT functions
    sys.exit("run without TRITON_INTERPRET=1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
ROOT = Path(__file__).resolve().parents[1]
# SLIPSTREAM_SRC: another checkout's tree (e.g. `git archive` of an older commit) to model its kernels
sys.path.insert(0, os.environ.get("SLIPSTREAM_SRC", str(ROOT)))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sass  # noqa: E402


@dataclass(frozen=True)
class H100:
    sms: int = 132
    clock_hz: float = 1.755e9
    schedulers: int = 4
    copy_bw: float = 3.0e12          # bytes/s: the roofline's bandwidth (assumed until measured)
    hbm_ns: float = 600.0
    l2_ns: float = 270.0
    sm_bytes_per_cycle: float = 64.0
    atomic_ns: float = 400.0
    launch_ns: float = 1300.0
    l2_bw: float = 5.5e12            # bytes/s, L2 hits (Chips and Cheese's H100 L2 bandwidth test)
    barrier_cycles: float = 30.0
    spill_cycles: float = 35.0       # per local-memory load/store in a loop body
    regs_per_sm: int = 65536
    shared_per_sm: int = 233472
    max_blocks_per_sm: int = 32


HW = H100()


@dataclass
class LoopCost:
    """One loop iteration as compiled."""
    instructions: int
    barriers: int
    load_bytes_per_thread: int
    weight_bytes_per_thread: int  # of those, weights (plain loads; activations are .cg: LDG...STRONG.GPU)
    in_flight: int                # chunks of weight loads in flight (2: carried to the next iteration)
    act_in_flight: int = 2        # the same for the activation (.cg, L2) loads: 1 = an L2 round trip per step
    local_ops: int = 0            # local-memory (spill) loads and stores in the body (LDL/STL)

    def seconds(self, warps: int, bytes_per_iter: float, bw_sm: float, latency_ns: float) -> float:
        cyc = self.instructions * warps / HW.schedulers + self.barriers * HW.barrier_cycles
        cyc += self.local_ops * HW.spill_cycles
        issue = cyc / HW.clock_hz
        bw = min(bw_sm, HW.sm_bytes_per_cycle * HW.clock_hz)
        l2_wait = HW.l2_ns * 1e-9 + issue if self.act_in_flight == 1 else 0.0
        return max(issue, bytes_per_iter / bw, (latency_ns * 1e-9 + issue) / self.in_flight, l2_wait)


def _in_flight(loop: sass.Loop, strong: bool = False) -> int:
    """2 when none of the loop's global loads (of weights; with `strong`, of activations: the `.cg`
    loads, compiled as LDG.E...STRONG.GPU) is read later in the iteration that issues it."""
    import re
    loads = [(k, i) for k, i in enumerate(loop.insts) if i.base == "LDG" and ("STRONG" in i.opcode) == strong]
    if not loads:
        return 1
    for k, ld in loads:
        m = re.match(r"\s*R(\d+)", ld.operands)
        if not m:
            continue
        r0, n = int(m.group(1)), max(1, ld.load_bytes // 4)
        regs = {f"R{r0 + j}" for j in range(n)}
        for later in loop.insts[k + 1:]:
            if later.base == "MOV" or later.opcode == "IMAD.MOV.U32":   # a loop-carried copy
                continue
            srcs = later.operands.split(",")[1:] if later.base not in ("STG", "STS", "RED", "ST") else \
                later.operands.split(",")
            if any(re.search(rf"\b{r}\b", s) for s in srcs for r in regs):
                return 1
    return 2


def _async_stages(loop: sass.Loop) -> int:
    """Chunks in flight in a loop that Triton's pipeliner turned into asynchronous copies to shared
    memory (LDGSTS, cp.async): a wait `DEPBAR.LE SB0, N` leaves N later chunks in flight while this
    one is used, so N + 1 (the smallest N of the loop's waits); 0 when the loop has no LDGSTS."""
    import re
    if not any(i.base == "LDGSTS" for i in loop.insts):
        return 0
    ns = [int(m.group(1), 16) for i in loop.insts if i.base == "DEPBAR"
          for m in [re.search(r"SB0,\s*0x([0-9a-f]+)", i.operands)] if m]
    return min(ns) + 1 if ns else 1


def loop_cost(loop: sass.Loop) -> LoopCost:
    c = loop.counts
    weights = sum(i.load_bytes for i in loop.insts if i.base == "LDG" and "STRONG" not in i.opcode)
    stages = _async_stages(loop)
    if stages:   # cp.async: weights and activations alike, `stages` chunks in flight (bytes: from the plan)
        return LoopCost(loop.size, c["BAR"], c["LDG_BYTES"], 0, stages, stages, c["LDL"] + c["STL"])
    return LoopCost(loop.size, c["BAR"], c["LDG_BYTES"], weights, _in_flight(loop), _in_flight(loop, strong=True),
                    c["LDL"] + c["STL"])


# -- the megakernel ---------------------------------------------------------------------------------
def _op_branches(path: Path) -> tuple[dict[int, tuple[int, int]], list[str]]:
    """{opcode: (first line, last line)} of the `if op == OPCODE` chain in `_megakernel` (the opcodes
    named as in the task table), and the source lines."""
    from slipstream.kernels.triton.task_table import Op
    text = path.read_text()
    tree = ast.parse(text)
    out: dict[int, tuple[int, int]] = {}
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_megakernel")
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "op" and \
                isinstance(node.test.comparators[0], ast.Name) and node.test.comparators[0].id in Op.__members__:
            op = int(Op[node.test.comparators[0].id])
            out[op] = (node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno)
            if node.orelse and not isinstance(node.orelse[0], ast.If):   # the final else: the last opcode
                out[op + 100] = (node.orelse[0].lineno, node.orelse[-1].end_lineno or node.orelse[-1].lineno)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "last_split":
            # since plan version 3 the group's merge (ATTN_REDUCE) runs in the last split, after its signal
            out[int(Op.ATTN_REDUCE)] = (node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno)
    last = max(k for k in out if k < 100)
    if last + 100 in out:
        out[last + 1] = out.pop(last + 100)
    return out, text.splitlines()


def _branch_of(branches: dict[int, tuple[int, int]], line: int) -> int | None:
    """The opcode of the innermost branch holding source line `line` (the merge, ATTN_REDUCE, lies
    inside the ATTN_SPLIT branch since plan version 3)."""
    best = None
    for op, (a, b) in branches.items():
        if a <= line <= b and (best is None or b - a < branches[best][1] - branches[best][0]):
            best = op
    return best


KINDS = (("LMV_OFF", "argmax"), ("_rms_rstd(", "rstd"), ("_mv", "mv"), ("_prefetch_weights(", "prefetch"),
         ("BT_OFF", "attn"),
         ("PM_OFF", "reduce"), ("LOGITS_OFF + b * V", "argmax"), ("ARGMAX", "argmax"), ("sync_ptr + wait_ev", "spin"))


@dataclass
class MegakernelCode:
    loops: dict[int, list[tuple[str, LoopCost]]]    # opcode -> its loops in code order, with their kind
    regs: int
    spill: int
    warps: int
    spin: LoopCost | None = None    # the wait's spin loop (with PREFETCH=1 it also reads an O-tile chunk)
    straight: dict[int, LoopCost] | None = None   # opcode -> its branch's code outside innermost loops
    # ... of which the part inside a loop over batch rows (`for b in range(0, B)`: attention, argmax)
    straight_rows: dict[int, LoopCost] | None = None


def _row_loop_lines(src: list[str]) -> set[int]:
    """Source lines inside `_megakernel`'s loops over batch rows (`for b in range(...)`): their code
    outside innermost loops runs once per row, the rest of a branch once per task."""
    tree = ast.parse("\n".join(src))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_megakernel")
    out: set[int] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == "b":
            out.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return out


def _spin_lines(src: list[str]) -> set[int]:
    """Source lines of the body of `_megakernel`'s spin loop (`while (seen < target) ...`)."""
    first = next(i for i, t in enumerate(src) if t.strip().startswith("while (seen < target)"))
    indent = len(src[first]) - len(src[first].lstrip())
    out = set()
    for j in range(first + 1, len(src)):
        t = src[j]
        if t.strip() and len(t) - len(t.lstrip()) <= indent:
            break
        out.add(j + 1)
    return out


def megakernel_code(plan, num_warps: int = 8, prefetch: int = 0) -> MegakernelCode:
    from slipstream.runtime import megakernel as mk
    from slipstream.runtime.megakernel import kernel_constants
    k = mk.compile_offline(plan, num_warps=num_warps, prefetch=prefetch)
    use = mk.resource_usage(k.asm["cubin"])
    text = sass.disassemble(k.asm["cubin"])
    from slipstream.kernels.triton import megakernel as kernel_src
    branches, src = _op_branches(Path(kernel_src.__file__))
    per_op: dict[int, list[tuple[str, LoopCost]]] = {}
    spin_src = _spin_lines(src)
    spin = None
    for lp in sass.loops(text):
        if not lp.innermost:
            continue
        lines = sorted(ln for f, ln in lp.lines() if f == "megakernel.py")
        if spin is None and spin_src & set(lines) and any("STRONG" in i.opcode for i in lp.insts if i.base == "LDG"):
            spin = loop_cost(lp)
        # ptxas may merge identical tails of two branches: such a loop counts for each of them
        ops = sorted({o for ln in lines if (o := _branch_of(branches, ln)) is not None})
        for op in ops:
            body = "\n".join(src[ln - 1] for ln in lines if _branch_of(branches, ln) == op)
            kind = next((kd for key, kd in KINDS if key in body), "other")
            per_op.setdefault(op, []).append((kind, loop_cost(lp)))
    # each branch's code outside its innermost loops (set-up, loop tails, reductions after a loop,
    # stores), issued once per task (per batch row where the branch loops over rows)
    insts, _ = sass.parse(text)
    looped: set[int] = set()
    for lp in sass.loops(text):
        if lp.innermost:
            looped.update(range(lp.start, lp.end + 1))
    straight: dict[int, LoopCost] = {}
    straight_rows: dict[int, LoopCost] = {}
    row_lines = _row_loop_lines(src)
    for j, ins in enumerate(insts):
        if j in looped or Path(ins.file).name != "megakernel.py":
            continue
        op_of = _branch_of(branches, ins.line)
        if op_of is not None:
            sc = (straight_rows if ins.line in row_lines else straight).setdefault(op_of, LoopCost(0, 0, 0, 0, 1))
            sc.instructions += 1
            sc.barriers += ins.base == "BAR"
            sc.local_ops += ins.base in ("LDL", "STL")
    consts = kernel_constants(plan)
    t = plan.tiles
    qkv_tile = plan.head_dim // 2 // getattr(t, "qkv_parts", 1)
    shape_of = {1: (qkv_tile, True), 4: (t.o, False), 5: (t.gate_up, True), 6: (t.down, False),
                7: (t.lm_head, False)}
    names = {1: "QKV_ROPE", 4: "O_PROJ", 5: "GATE_UP", 6: "DOWN", 7: "LM_HEAD"}
    key = {op: (*shape_of[op], consts.get(BK_NAME[n])) for op, n in names.items()}
    for op in names:
        if not any(kd == "mv" for kd, _ in per_op.get(op, [])):
            # ptxas merged two branches' identical loops (same tile, K-chunk, one or two matrices)
            twin = next((o for o in names if o != op and key[o] == key[op] and
                         any(kd == "mv" for kd, _ in per_op.get(o, []))), None)
            if twin is None:
                raise RuntimeError(f"no matvec loop found for opcode {op} in the compiled megakernel")
            per_op.setdefault(op, []).extend((kd, lc) for kd, lc in per_op[twin] if kd == "mv")
    return MegakernelCode(per_op, use.get("reg", 0), use.get("stack", 0), num_warps, spin, straight, straight_rows)


def _task_seconds(plan, code: MegakernelCode, r: list[int], bw_sm: float, consts: dict[str, Any],
                  context: int, weights_in_l2: bool = False) -> tuple[float, float]:
    """(seconds of the task's body, weight/KV bytes it reads from HBM). `weights_in_l2`: the task's
    weights were prefetched while it waited (its matvec loads then see L2 latency and bandwidth)."""
    w_lat = HW.l2_ns if weights_in_l2 else HW.hbm_ns
    w_bw = bw_sm * (HW.l2_bw / HW.copy_bw) if weights_in_l2 else bw_sm
    from slipstream.runtime.plan import Op
    op, t0, t1 = r[0], r[2], r[3]
    B, Hd, F, V = plan.batch, plan.hidden_size, plan.intermediate_size, plan.vocab_size
    D, G = plan.head_dim, plan.group
    bk = consts["BLOCK_K"]
    warps = code.warps
    total, hbm = 0.0, 0.0
    loops = code.loops.get(op, [])
    # QKV: rotation pairs [t0, t1) of one head, two rows each (an older tree: one task per head)
    qkv_rows = 2 * (t1 - t0) if hasattr(plan.tiles, "qkv_parts") else D
    rows_of = {Op.QKV_ROPE: qkv_rows, Op.O_PROJ: t1 - t0, Op.GATE_UP: t1 - t0, Op.DOWN: t1 - t0, Op.LM_HEAD: t1 - t0}
    k_of = {Op.QKV_ROPE: Hd, Op.O_PROJ: plan.num_heads * D, Op.GATE_UP: Hd, Op.DOWN: F, Op.LM_HEAD: Hd}
    mv_loops = [lc for kd, lc in loops if kd == "mv"]
    if code.straight and op in code.straight:
        # (a tree without `straight_rows`: the attention and argmax branches charged per row throughout)
        per_row = code.straight_rows is None and op in (Op.ATTN_SPLIT, Op.ATTN_REDUCE, Op.ARGMAX)
        total += (B if per_row else 1) * code.straight[op].seconds(warps, 0, bw_sm, 0.0)
    if code.straight_rows and op in code.straight_rows:
        total += B * code.straight_rows[op].seconds(warps, 0, bw_sm, 0.0)
    for kind, lc in loops:
        if kind == "rstd":
            it = math.ceil(Hd / lc_block(consts, "rstd"))
            total += it * lc.seconds(warps, B * lc_block(consts, "rstd") * 4, bw_sm, HW.l2_ns)
        elif kind == "mv":
            rows, K = rows_of[Op(op)], k_of[Op(op)]
            share = rows / len(mv_loops) * (2 if Op(op) == Op.GATE_UP and len(mv_loops) == 1 else 1)
            task_bytes = share * K * 2
            # the weight bytes one iteration loads, as compiled (16-byte loads x threads): sets the trips
            per_iter = lc.weight_bytes_per_thread * 32 * warps or share * consts.get(BK_NAME[Op(op).name], bk) * 2
            per_iter = min(per_iter, task_bytes)
            it = math.ceil(task_bytes / per_iter)
            total += it * lc.seconds(warps, per_iter, w_bw, w_lat)
            hbm += task_bytes
        elif kind == "attn":
            P = plan.tiles.partition
            s = t1
            for _ in range(B):
                n = max(0, min(P, context - s * P))
                it = math.ceil(n / consts["BLOCK_T"])
                nbytes = 2 * consts["BLOCK_T"] * D * 2
                total += it * lc.seconds(warps, nbytes, bw_sm, HW.hbm_ns)
                hbm += 2 * n * D * 2
        elif kind == "reduce":
            it = max(1, math.ceil(math.ceil(context / plan.tiles.partition) / consts["S_BLOCK"]))
            total += B * it * lc.seconds(warps, G * consts["S_BLOCK"] * 4, bw_sm, HW.l2_ns)
        elif kind == "argmax":
            n_items = plan.lm_tiles if consts.get("LM_TILE") else V    # per-tile partials, or every logit
            it = math.ceil(n_items / consts["BLOCK_V"])
            total += B * it * lc.seconds(warps, consts["BLOCK_V"] * 4, bw_sm, HW.l2_ns)
    return total, hbm


BK_NAME = {"QKV_ROPE": "BK_QKV", "O_PROJ": "BK_O", "GATE_UP": "BK_GU", "DOWN": "BK_DOWN", "LM_HEAD": "BK_LM"}


def lc_block(consts: dict[str, int], kind: str) -> int:
    return consts.get("BLOCK_S", consts["BLOCK_K"]) if kind == "rstd" else consts["BLOCK_K"]


def model_megakernel(plan, context: int, programs_per_sm: int = 1, prefetch: int = 0,
                     num_warps: int = 8) -> dict[str, Any]:
    from slipstream.runtime.megakernel import kernel_constants
    from slipstream.runtime.plan import Op
    code = megakernel_code(plan, num_warps=num_warps, prefetch=prefetch)
    consts = kernel_constants(plan)
    rows = plan.tasks.tolist()
    phase: dict[tuple[int, int], int] = {}
    for r in rows:
        phase[(r[0], r[1])] = phase.get((r[0], r[1]), 0) + 1
    P = HW.sms * programs_per_sm
    ev_count = [0] * plan.num_events
    ev_time = [0.0] * plan.num_events
    # per task: the ticket atomic, the task row (an L2 hit), the satisfied poll; a kernel that draws
    # its next ticket as a task begins (`TICKET_AHEAD`): a program's later tasks wait for that atomic
    # only while it is still in flight, then pay the row load and the poll
    ahead = bool(consts.get("TICKET_AHEAD", 0))
    ticket_ready: dict[int, float] = {}
    # `ROW_AHEAD`: the next task's row is loaded just before a task's signal (once its ticket is in),
    # so the row's L2 trip overlaps the signal's round trip; an attention split that does not merge
    # loads it after its (already sent) signal, as before
    row_ahead = ahead and bool(consts.get("ROW_AHEAD", 0))
    row_ready: dict[int, float] = {}
    signal = HW.atomic_ns * 1e-9
    busy = 0.0
    end = 0.0
    by_op: dict[str, float] = {}
    import heapq
    heap = [(0.0, p) for p in range(P)]
    heapq.heapify(heap)
    timeline: list[tuple[int, int, float, float, float]] = []   # (op, layer, drawn, started, done)
    # plan version 3: no ATTN_REDUCE rows; the split that finishes last in its group (its signal is an
    # acq_rel count whose result it waits for: the `signal` round trip already charged) runs the merge
    # at once (no ticket, row or poll) and then signals the row's AUX event
    merged = not any(r[0] == int(Op.ATTN_REDUCE) for r in rows)
    split_left = {r[6]: plan.event_counts[r[6]] for r in rows if merged and r[0] == int(Op.ATTN_SPLIT)}
    split_last: dict[int, tuple[float, int]] = {}    # split event -> (latest done, its program)
    for r in rows:
        t_free, p = heapq.heappop(heap)
        if row_ahead and p in row_ready:
            row_at = max(t_free, row_ready[p])
        elif ahead and p in ticket_ready:
            row_at = max(t_free, ticket_ready[p]) + HW.l2_ns * 1e-9
        else:
            row_at = t_free + (HW.atomic_ns + HW.l2_ns) * 1e-9
        ticket_ready[p] = row_at + HW.atomic_ns * 1e-9      # (ahead) the next ticket, issued now
        start = row_at + HW.atomic_ns * 1e-9                 # the satisfied poll
        pf_frac = 0.0
        if r[4] >= 0:
            ready = ev_time[r[4]] + HW.atomic_ns * 1e-9
            if prefetch == 1 and ready > start and r[0] == int(Op.O_PROJ) and code.spin is not None:
                # PREFETCH=1: a waiting O_PROJ task reads one chunk of its tile per spin (the chunk
                # spin loop as compiled: its chunk loads and its poll in flight together); it proceeds
                # at the end of the first chunk spin that began once the event was visible, and runs the
                # chunks it read from L2. Once the tile is read it polls in the plain spin loop (a poll
                # round trip after the event is visible, as every other wait is modelled)
                bw_pf = HW.copy_bw / (min(phase[(r[0], r[1])], HW.sms) * programs_per_sm)
                chunk = code.spin.weight_bytes_per_thread * 32 * code.warps
                _, wbytes = _task_seconds(plan, code, r, HW.copy_bw, consts, context)
                n_pf = math.ceil(wbytes / chunk) if chunk else 0
                t_chunk = code.spin.seconds(code.warps, chunk, bw_pf, HW.hbm_ns)
                # (the wait's first poll, issued with the row, is checked before any chunk spin)
                visible, tcur, k = ev_time[r[4]], start, 0
                seen = visible <= start - HW.atomic_ns * 1e-9
                while k < n_pf and not seen:
                    seen = tcur >= visible
                    tcur += t_chunk
                    k += 1
                ready = tcur if seen or k == 0 else max(tcur, visible) + HW.atomic_ns * 1e-9
                pf_frac = min(1.0, min(k, n_pf) * chunk / wbytes) if wbytes else 0.0
            start = max(start, ready)
        active = min(phase[(r[0], r[1])], HW.sms) * 1.0
        bw_sm = HW.copy_bw / active / programs_per_sm
        body, _ = _task_seconds(plan, code, r, bw_sm, consts, context)
        if pf_frac:
            body = pf_frac * _task_seconds(plan, code, r, bw_sm, consts, context, True)[0] + (1 - pf_frac) * body
        done = start + body + signal
        if row_ahead:   # issued when the signal begins (a split that does not merge: after its signal)
            sig_at = done if r[0] == int(Op.ATTN_SPLIT) else done - signal
            row_ready[p] = max(sig_at, ticket_ready[p]) + HW.l2_ns * 1e-9
        busy += body
        timeline.append((r[0], r[1], t_free, start, done))
        by_op[Op(r[0]).name] = by_op.get(Op(r[0]).name, 0.0) + body
        ev_count[r[6]] += 1
        ev_time[r[6]] = max(ev_time[r[6]], done)
        heapq.heappush(heap, (done, p))
        end = max(end, done)
        if merged and r[0] == int(Op.ATTN_SPLIT):
            if done >= split_last.get(r[6], (-1.0, -1))[0]:
                split_last[r[6]] = (done, p)
            split_left[r[6]] -= 1
            if split_left[r[6]] == 0:
                # every split of the group is placed: the latest to finish merges. Its program cannot
                # have taken another task yet (every split placed after it finishes later)
                t_last, p_last = split_last[r[6]]
                red = [int(Op.ATTN_REDUCE), r[1], r[2], r[2] + 1, r[6], 0, r[9], -1, -1, 0]
                mbody, _ = _task_seconds(plan, code, red, bw_sm, consts, context)
                mdone = t_last + mbody + signal
                if row_ahead:   # the merge loads its program's next row before its signal
                    row_ready[p_last] = max(mdone - signal, ticket_ready[p_last]) + HW.l2_ns * 1e-9
                k = heap.index((t_last, p_last))
                heap[k] = (mdone, p_last)
                heapq.heapify(heap)
                busy += mbody
                timeline.append((int(Op.ATTN_REDUCE), r[1], t_last, t_last, mdone))
                by_op["ATTN_REDUCE"] = by_op.get("ATTN_REDUCE", 0.0) + mbody
                ev_count[r[9]] += 1
                ev_time[r[9]] = max(ev_time[r[9]], mdone)
                end = max(end, mdone)
    roof = roofline_bytes(plan, context)
    t = max(end, roof / HW.copy_bw) + HW.launch_ns * 1e-9
    return {"us": t * 1e6, "pct_roofline": 100.0 * roof / HW.copy_bw / t, "tasks": len(rows),
            "registers": code.regs, "spill_bytes": code.spill,
            "busy_us_per_sm_by_op": {k: round(v * 1e6 / P, 1) for k, v in by_op.items()},
            "timeline": timeline,
            "loops": {str(op): [(kd, vars(lc)) for kd, lc in ls] for op, ls in sorted(code.loops.items())}}


def roofline_bytes(plan, context: int) -> float:
    """Weights (bf16: every matrix once, norms fp32, B embedding rows when untied) + KV read at `context`."""
    Hd, F, V, H, KVH, D, L = (plan.hidden_size, plan.intermediate_size, plan.vocab_size, plan.num_heads,
                              plan.num_kv_heads, plan.head_dim, plan.num_layers)
    per_layer = ((H + 2 * KVH) * D * Hd + Hd * H * D + 2 * F * Hd + Hd * F) * 2 + 2 * Hd * 4
    w = L * per_layer + V * Hd * 2 + Hd * 4
    if not plan.weights.tied:
        w += plan.batch * Hd * 2
    kv = plan.batch * context * L * 2 * KVH * D * 2
    return float(w + kv)


# -- the graph path ---------------------------------------------------------------------------------
_COMPILED: dict[str, dict[str, Any]] = {}


def _compiled(launch) -> dict[str, Any]:
    """Loops and resources of a launch's kernel, compiled once per specialisation."""
    key = _launch_key(launch)
    if key not in _COMPILED:
        _COMPILED[key] = _compile(launch)
    return _COMPILED[key]


def _compile(launch) -> dict[str, Any]:
    from slipstream.kernels.triton.offline import compile_launch
    from slipstream.runtime.megakernel import resource_usage
    k = compile_launch(launch)
    text = sass.disassemble(k.asm["cubin"])
    inner = [lp for lp in sass.loops(text) if lp.innermost]
    use = resource_usage(k.asm["cubin"])
    looped = {j for lp in inner for j in range(lp.start, lp.end + 1)}
    rest = [i for j, i in enumerate(sass.parse(text)[0]) if j not in looped]
    straight = LoopCost(len(rest), sum(i.base == "BAR" for i in rest), 0, 0, 1,
                        local_ops=sum(i.base in ("LDL", "STL") for i in rest))
    return {"loops": [loop_cost(lp) for lp in inner], "straight": straight,
            "regs": use.get("reg", 0), "spill": use.get("stack", 0),
            "shared": int(k.metadata.shared), "warps": int(k.metadata.num_warps)}


def _launch_key(launch) -> str:
    def sig(v):
        if hasattr(v, "dtype") and hasattr(v, "shape"):
            return f"{v.dtype}{tuple(v.shape)}"
        return repr(v)
    return launch.kernel + "|" + ",".join(sig(a) for a in launch.args) + "|" + \
        ",".join(f"{k}={sig(v)}" for k, v in sorted(launch.kwargs.items()))


def _iterations(launch, context: int) -> tuple[int, float]:
    """(iterations of the kernel's main loop per program, HBM bytes per program) from its arguments."""
    name, a, kw = launch.kernel, launch.args, launch.kwargs
    named = dict(zip(launch.fn.arg_names, a))
    if name.endswith("_matvec_kernel"):
        w = named["w_ptr"]
        K, k_split = named["K"], named["k_per_split"]
        rows = kw["BLOCK_N"] * (2 if kw["GLU"] else 1)
        it = math.ceil(min(k_split, K) / kw["BLOCK_K"])
        esz = w.element_size() if w.dtype.is_floating_point or w.element_size() > 1 else 1
        per_k = w.shape[1] / K if w.shape[1] != K else 1.0
        return it, rows * min(k_split, K) * esz * per_k
    if name.endswith("_paged_decode_split_kernel"):
        part, bn = kw.get("PARTITION", 256), kw.get("BLOCK_N", 16)
        n = min(part, context)
        k = named["k_ptr"]
        return math.ceil(n / bn), 2 * n * k.shape[-1] * k.element_size()
    if name.endswith("_argmax_kernel"):
        V = named["x_ptr"].shape[-1]
        return math.ceil(V / kw.get("BLOCK", 1024)), 0.0
    return 1, 0.0


def model_graph(cfg, batch: int, context: int) -> dict[str, Any]:
    from slipstream.kernels.triton import offline
    from slipstream.runtime.graph import meta_decoder
    with offline.as_gpu(HW.sms):
        dec, s = meta_decoder(cfg, batch, context)
        with offline.record() as launches:
            dec._body(s)
    total = HW.launch_ns * 1e-9     # the embedding copy (a torch kernel in the graph)
    per_kernel: dict[str, float] = {}
    for ln in launches:
        info = _compiled(ln)
        regs = max(info["regs"], 1)
        threads = 32 * info["warps"]
        occ = max(1, min(HW.max_blocks_per_sm, HW.regs_per_sm // (regs * threads),
                         HW.shared_per_sm // max(info["shared"], 1)))
        slots = HW.sms * occ
        conc = min(ln.programs, slots)
        bw_sm = HW.copy_bw / min(ln.programs, HW.sms) / max(1, conc // HW.sms)
        it, nbytes = _iterations(ln, context)
        prog = 0.0
        loops = info["loops"]
        if loops:
            main = max(loops, key=lambda lc: lc.load_bytes_per_thread)
            prog = it * main.seconds(info["warps"], nbytes / max(it, 1), bw_sm, HW.hbm_ns)
            prog += sum(lc.seconds(info["warps"], 0, bw_sm, HW.l2_ns) for lc in loops if lc is not main)
        prog += info["straight"].seconds(info["warps"], 0, bw_sm, 0.0)   # its code outside innermost loops
        prog += HW.hbm_ns * 1e-9      # the program's first dependent loads and its stores
        waves = math.ceil(ln.programs / slots)
        body = max(waves * prog, ln.programs * nbytes / HW.copy_bw)
        t = HW.launch_ns * 1e-9 + body
        per_kernel[ln.kernel] = per_kernel.get(ln.kernel, 0.0) + t
        total += t
    return {"us": total * 1e6, "launches": len(launches) + 1,
            "per_kernel_us": {k: round(v * 1e6, 1) for k, v in per_kernel.items()}}


def model(shape: str, batch: int, context: int = 512, programs_per_sm: int = 1, prefetch: int = 0,
          fill: bool = True) -> dict:
    from slipstream.models.random_init import shape_config
    from slipstream.runtime.megakernel import default_tiles
    from slipstream.runtime.plan import WeightLayout, compile_plan
    cfg = shape_config(shape)
    try:
        tiles = default_tiles(cfg, context, HW.sms * programs_per_sm, fill=fill)
    except TypeError:     # an older tree (SLIPSTREAM_SRC) without the fill option
        tiles = default_tiles(cfg, context, HW.sms * programs_per_sm)
    plan = compile_plan(cfg, batch, context, 16, WeightLayout.for_config(cfg, cfg.tie_word_embeddings), tiles)
    roof_s = roofline_bytes(plan, context) / HW.copy_bw
    g = model_graph(cfg, batch, context)
    m = model_megakernel(plan, context, programs_per_sm, prefetch)
    return {"modelled": True, "shape": shape, "batch": batch, "context": context,
            "roofline_us": round(roof_s * 1e6, 1),
            "graph_us": round(g["us"], 1), "graph_pct_roofline": round(100 * roof_s * 1e6 / g["us"], 1),
            "graph_launches": g["launches"], "graph_per_kernel_us": g["per_kernel_us"],
            "megakernel_us": round(m["us"], 1), "megakernel_pct_roofline": round(m["pct_roofline"], 1),
            "megakernel_tasks": m["tasks"], "megakernel_registers": m["registers"],
            "megakernel_spill_bytes": m["spill_bytes"], "programs_per_sm": programs_per_sm, "prefetch": prefetch,
            "megakernel_vs_graph": round(g["us"] / m["us"], 2), "megakernel_loops": m["loops"],
            "megakernel_busy_us_per_sm_by_op": m["busy_us_per_sm_by_op"], "megakernel_timeline": m["timeline"]}


def phase_table(timeline: list[tuple[int, int, float, float, float]], layer: int) -> list[str]:
    """One layer's phases on the modelled timeline (us from the layer's first task start): tasks, first
    draw, first start, last start, last done, and the mean body (done - start)."""
    from slipstream.runtime.plan import Op
    mine = [t for t in timeline if t[1] == layer and t[0] not in (int(Op.EMBED), int(Op.LM_HEAD), int(Op.ARGMAX))]
    t0 = min(t[3] for t in mine)
    out = [f"| layer {layer} phase | tasks | first drawn | first start | last start | last done | mean body |  "
           "(us, *modelled*)", "|---|---|---|---|---|---|---|"]
    for op in Op:
        ts = [t for t in mine if t[0] == int(op)]
        if not ts:
            continue
        us = [(a - t0) * 1e6 for a in (min(t[2] for t in ts), min(t[3] for t in ts), max(t[3] for t in ts),
                                       max(t[4] for t in ts))]
        body = sum(t[4] - t[3] for t in ts) / len(ts) * 1e6
        out.append(f"| {op.name} | {len(ts)} | " + " | ".join(f"{u:.2f}" for u in us) + f" | {body:.2f} |")
    return out


def resources(shapes: list[str], batches: list[int], context: int) -> None:
    """Registers, spill stack and 16-byte loads of the megakernel as the runtime builds it
    (`default_tiles` for 132 SMs), with the Triton that runs this script (compiled, not modelled)."""
    import re

    import triton

    from slipstream.models.random_init import shape_config
    from slipstream.runtime import megakernel as mk
    from slipstream.runtime.plan import WeightLayout, compile_plan
    print(f"| shape | batch | registers | spill stack (bytes) | 16-byte loads | 16-byte cp.async |  (Triton "
          f"{triton.__version__}, sm_90a, 8 warps, context {context}, default_tiles)")
    print("|---|---|---|---|---|---|")
    for sh in shapes:
        cfg = shape_config(sh)
        for b in batches:
            plan = compile_plan(cfg, b, context, 16, WeightLayout.for_config(cfg, cfg.tie_word_embeddings),
                                mk.default_tiles(cfg, context, HW.sms))
            k = mk.compile_offline(plan)
            use = mk.resource_usage(k.asm["cubin"])
            ptx = k.asm["ptx"]
            cp16 = len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*\],\s*(?:16|0x10),", ptx))
            print(f"| {sh} | {b} | {use['reg']} | {use['stack']} | {ptx.count('ld.global.v4')} | {cp16} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description="MODELLED H100 decode-step latency (no GPU)")
    ap.add_argument("--shape", default=None, help="dense-1B or dense-8B (default both)")
    ap.add_argument("--batch", type=int, default=None, help="default 1, 4 and 8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--programs-per-sm", type=int, default=1)
    ap.add_argument("--prefetch", type=int, default=0)
    ap.add_argument("--no-fill", action="store_true", help="the plan's base tiles (phases may have < SMs tasks)")
    ap.add_argument("--resources", action="store_true",
                    help="only the megakernel's compiled registers / spill / vector loads (not modelled)")
    ap.add_argument("--verbose", action="store_true", help="per-kernel and per-loop detail")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    ap.add_argument("--timeline", type=int, default=None, metavar="LAYER",
                    help="print that layer's phases on the modelled megakernel timeline")
    a = ap.parse_args()
    shapes = [a.shape] if a.shape else ["dense-1B", "dense-8B"]
    batches = [a.batch] if a.batch else [1, 4, 8]
    if a.resources:
        resources(shapes, batches, a.context)
        return
    results = []
    print("| shape | batch | roofline us | graph us (modelled) | graph % roofline (modelled) | "
          "megakernel us (modelled) | megakernel % roofline (modelled) | mk / graph (modelled) |")
    print("|---|---|---|---|---|---|---|---|")
    for sh in shapes:
        for b in batches:
            r = model(sh, b, a.context, a.programs_per_sm, a.prefetch, not a.no_fill)
            results.append(r)
            print(f"| {sh} | {b} | {r['roofline_us']} | {r['graph_us']} | {r['graph_pct_roofline']} | "
                  f"{r['megakernel_us']} | {r['megakernel_pct_roofline']} | {r['megakernel_vs_graph']}x |",
                  flush=True)
    if a.timeline is not None:
        for r in results:
            print(f"{r['shape']} batch {r['batch']}:")
            print("\n".join(phase_table(r["megakernel_timeline"], a.timeline)))
    if a.verbose:
        for r in results:
            print(json.dumps({k: r[k] for k in ("shape", "batch", "graph_per_kernel_us", "megakernel_loops",
                                                "megakernel_busy_us_per_sm_by_op")}))
    if a.json:
        slim = [{k: v for k, v in r.items() if k not in ("megakernel_loops", "graph_per_kernel_us",
                                                           "megakernel_busy_us_per_sm_by_op", "megakernel_timeline")}
                for r in results]
        print(json.dumps(slim[0] if len(slim) == 1 else {"modelled": True, "results": slim}))


if __name__ == "__main__":
    main()
