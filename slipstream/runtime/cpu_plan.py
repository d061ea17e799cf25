"""The CPU step (decode rows, short prompt chunks) as a table of tile tasks linked by event counters
(run by `kernels/cpu/step.c`).

The table has the megakernel plan's shape (`runtime/plan/`): one row per task in topological order with the
columns OP, LAYER, T0, T1, WAIT_EV, WAIT_COUNT, SIG_EV, AUX. A task waits until event WAIT_EV has
been signalled WAIT_COUNT times, runs, and signals SIG_EV once. The CPU's opcodes differ from the
GPU's (a CPU task quantizes its own output for the next product, a GPU task does not), the contract
is the same: every wait is on an event whose signallers all come earlier in the order, so the table
completes with any number of threads, one included. `validate` checks that statically.

Tiles are sized for the thread count: at least a few tasks per thread in every operator (dynamic
load balance when a thread is slowed down), and no tile larger than about 256 KB of weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLUMNS = ("OP", "LAYER", "T0", "T1", "WAIT_EV", "WAIT_COUNT", "SIG_EV", "AUX")
OP, LAYER, T0, T1, WAIT_EV, WAIT_COUNT, SIG_EV, AUX = range(len(COLUMNS))

# opcodes: the `OP_*` enum of step.c
EMBED, NORM, QKV, ATTN, PREP, O_PROJ, GATE_UP, DOWN, LM_HEAD, ARGMAX, POST = range(11)
ROUTE, EXPERT_GU, SHARED_GU, MOE_DOWN = range(11, 15)   # mixture-of-experts layers
OP_NAMES = ("EMBED", "NORM", "QKV", "ATTN", "PREP", "O_PROJ", "GATE_UP", "DOWN", "LM_HEAD", "ARGMAX", "POST",
            "ROUTE", "EXPERT_GU", "SHARED_GU", "MOE_DOWN")
POST_ATTN, POST_FFN = 0, 1
NORM_ATTN, NORM_FFN, NORM_FINAL = 0, 1, 2
TASKS_PER_THREAD = 1   # per product operator and thread (see _tiles)
MAX_ATTN_PARTS = 8   # step.c's MAX_PARTS
ATTN_SPLIT_ROWS = 8
NORM_ROWS = 8        # rows per RMSNorm task (a prompt chunk's rows are normalised in parallel)
ALL_HEADS = -1       # an ATTN task's t1 for all of its row's KV heads (attention_whole_rows)
ROW_UNIT = 16        # output rows of the O, DOWN and LM-head tiles come in multiples of this: AMX's blocks


class CpuPlanError(ValueError):
    """A task table that could deadlock or leave outputs unwritten."""


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts FFN's sizes (Qwen2-MoE, Qwen3-MoE)."""
    experts: int
    topk: int
    ffn: int                   # each expert's intermediate size
    shared_ffn: int            # the shared expert's (0: none)


@dataclass(frozen=True)
class Shape:
    """What the plan needs to know about the model."""
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    post_norms: bool = False             # Gemma: O and DOWN write a buffer that POST normalises into x
    moe: MoeShape | None = None          # the MoE layers' FFN
    moe_layers: tuple[int, ...] = ()     # which layers have it (the others: the dense GATE_UP / DOWN)


def _tiles(n: int, unit: int, threads: int) -> list[tuple[int, int]]:
    """[t0, t1) ranges over n rows in multiples of `unit`, TASKS_PER_THREAD per thread (as far as units
    allow). One long range per thread keeps each thread's weights one stream: against 4 per thread and at
    most 256 KB each (the first plan's choice), in process on the Xeon: batch-1 step 0.89x, batch 4 0.91x,
    batch 8 0.91x (docs/BENCHMARKS.md). A task that waits prefetches its first rows meanwhile."""
    units = -(-n // unit)
    count = max(1, min(units, threads * TASKS_PER_THREAD if threads > 1 else 1))
    per = -(-units // count)
    return [(a * unit, min(n, (a + per) * unit)) for a in range(0, units, per)]


def attention_parts(rows: int, kv_heads: int, threads: int) -> int:
    """Tasks each (row, KV head)'s attention gets: enough that one row's attention gives every thread two
    (at most MAX_ATTN_PARTS), for steps of up to ATTN_SPLIT_ROWS rows (decode batches; a prompt chunk's rows
    fill the team by themselves). step.c splits a context of n tokens into n // 256 parts (1 to 8, by n
    alone, so results depend on neither the team's size nor the rows beside it) and shares them among
    these tasks; a task with no part left returns at once."""
    if threads <= 1 or rows > ATTN_SPLIT_ROWS:
        return 1
    return max(1, min(MAX_ATTN_PARTS, -(-2 * threads // kv_heads)))


def attention_whole_rows(rows: int, threads: int) -> bool:
    """Whether each attention task takes all of a row's KV heads (t1 = ALL_HEADS) rather than one: where the
    rows alone give every thread two tasks. A slot's K (and V) rows of all heads are contiguous, so one task
    streams them in order, and prefetches them into L2 before it starts (batch-8 step 0.955-0.984x the
    per-head tasks', 0.939x at context 400: plan_ab.py --variants whole=0 whole=1)."""
    return rows >= 2 * max(threads, 1)


def _row_blocks(rows: int, threads: int) -> list[tuple[int, int]]:
    """[t0, t1) blocks of rows for the per-row operators (RMSNorm, POST): at most NORM_ROWS rows each, and a
    share of the rows for each thread where the rows are fewer than that. One task over a batch-8 step's rows
    left the other thread waiting at every norm (60 a step); two of four rows each: batch-8 step 0.968x,
    0.982x (plan_ab.py --batch 8 --context 100 --variants norm=8 norm=4, twice)."""
    per = max(1, min(NORM_ROWS, -(-rows // max(threads, 1))))
    return [(a, min(rows, a + per)) for a in range(0, rows, per)]


def build(shape: Shape, rows: int, threads: int, argmax: bool, out_rows: int | None = None) -> np.ndarray:
    """The task table [tasks, 8] int32 for a step of `rows` tokens (each a row attending over its own
    context: a decode row, or one token of a prompt chunk) of which `out_rows` (default: all) get
    logits: the final norm, LM head and argmax run over those only."""
    n_out = rows if out_rows is None else out_rows
    s = shape
    tasks: list[tuple[int, ...]] = []
    n_events = 0
    prev = (-1, 0)   # (event, count) the next operator waits on

    def op(code: int, layer: int, ranges: list[tuple[int, int]], aux: int = 0) -> None:
        group(layer, [(code, t0, t1, aux) for t0, t1 in ranges])

    def group(layer: int, items: list[tuple[int, int, int, int]]) -> None:
        """Tasks (code, t0, t1, aux) that wait on the previous group and signal one event together."""
        nonlocal n_events, prev
        ev = n_events
        n_events += 1
        for code, t0, t1, aux in items:
            tasks.append((code, layer, t0, t1, prev[0], prev[1], ev, aux))
        prev = (ev, len(items))

    qkv_heads = s.heads + 2 * s.kv_heads
    op(EMBED, -1, [(b, b + 1) for b in range(rows)])
    for layer in range(s.num_layers):
        op(NORM, layer, _row_blocks(rows, threads), NORM_ATTN)
        op(QKV, layer, _tiles(qkv_heads, 1, threads))
        parts = attention_parts(rows, s.kv_heads, threads)
        heads = [ALL_HEADS] if attention_whole_rows(rows, threads) else list(range(s.kv_heads))
        group(layer, [(ATTN, b, g, part | parts << 8) for b in range(rows) for g in heads for part in range(parts)])
        if s.head_dim % 32:
            op(PREP, layer, [(b, b + 1) for b in range(rows)])
        op(O_PROJ, layer, _tiles(s.hidden, ROW_UNIT, threads))
        if s.post_norms:
            op(POST, layer, _row_blocks(rows, threads), POST_ATTN)
        op(NORM, layer, _row_blocks(rows, threads), NORM_FFN)
        if s.moe is not None and layer in s.moe_layers:
            e = s.moe
            slots = expert_slots(e, rows)
            op(ROUTE, layer, [(0, rows)])
            per_slot = _tiles(e.ffn, 32, -(-threads // slots))
            items = [(EXPERT_GU, t0, t1, a) for a in range(slots) for t0, t1 in per_slot]
            if e.shared_ffn:
                items += [(SHARED_GU, t0, t1, 0)
                          for t0, t1 in _tiles(e.shared_ffn, 32, threads)]
            group(layer, items)
            op(MOE_DOWN, layer, _tiles(s.hidden, ROW_UNIT, threads))
        else:
            op(GATE_UP, layer, _tiles(s.ffn, 32, threads))
            op(DOWN, layer, _tiles(s.hidden, ROW_UNIT, threads))
        if s.post_norms:
            op(POST, layer, _row_blocks(rows, threads), POST_FFN)
    if n_out == 0:   # a prompt chunk that is not a prompt's end: no logits wanted
        return np.asarray(tasks, dtype=np.int32).reshape(-1, len(COLUMNS))
    op(NORM, -1, _row_blocks(n_out, threads), NORM_FINAL)
    op(LM_HEAD, -1, _tiles(s.vocab, ROW_UNIT, threads))
    if argmax:
        op(ARGMAX, -1, [(b, b + 1) for b in range(n_out)])
    return np.asarray(tasks, dtype=np.int32).reshape(-1, len(COLUMNS))


def expert_slots(moe: MoeShape, rows: int) -> int:
    """The most experts a step of `rows` rows can use: each row picks `topk` distinct ones."""
    return min(moe.experts, rows * moe.topk)


def num_events(table: np.ndarray) -> int:
    return int(table[:, SIG_EV].max()) + 1 if len(table) else 0


def validate(table: np.ndarray, shape: Shape, rows: int) -> None:
    """Raises CpuPlanError unless every wait is on an event all of whose signals come earlier in the
    order (so the table cannot deadlock with any number of threads) and every output is covered once.
    In numpy over the columns: a prompt chunk's table has ~100 tasks per row (51K for 512 rows), checked
    once per new row count."""
    if table.ndim != 2 or table.shape[1] != len(COLUMNS):
        raise CpuPlanError(f"a task table has {len(COLUMNS)} columns, got shape {table.shape}")
    n = len(table)
    op, sig, wev, wcnt = (table[:, c].astype(np.int64) for c in (OP, SIG_EV, WAIT_EV, WAIT_COUNT))
    bad = np.flatnonzero((op < 0) | (op >= len(OP_NAMES)))
    if bad.size:
        raise CpuPlanError(f"task {bad[0]}: unknown opcode {op[bad[0]]}")
    bad = np.flatnonzero(sig < 0)
    if bad.size:
        raise CpuPlanError(f"task {bad[0]}: signals no event")
    n_ev = int(sig.max()) + 1 if n else 0
    signals = np.bincount(sig, minlength=n_ev)
    last_signal = np.full(n_ev, -1, dtype=np.int64)
    np.maximum.at(last_signal, sig, np.arange(n))
    waits = wev >= 0
    known = waits & (wev < n_ev)
    ev = np.where(known, wev, 0)
    got = np.where(known, signals[ev] if n_ev else 0, 0)
    nothing = ~waits & (op != EMBED)
    miscount = waits & (got != wcnt)
    late = known & ~miscount & (last_signal[ev] >= np.arange(n)) if n_ev else np.zeros(n, dtype=bool)
    bad = np.flatnonzero(nothing | miscount | late)
    if bad.size:   # the first failing task, as a walk in order would report it
        i = int(bad[0])
        if nothing[i]:
            raise CpuPlanError(f"task {i} ({OP_NAMES[op[i]]}) waits on nothing")
        if miscount[i]:
            raise CpuPlanError(f"task {i} waits for {wcnt[i]} signals of event {wev[i]}, which gets {got[i]}")
        raise CpuPlanError(f"task {i} waits on event {wev[i]}, signalled by task {last_signal[ev[i]]} after it")
    _check_coverage(table, shape, rows)


def _check_coverage(table: np.ndarray, s: Shape, rows: int) -> None:
    moe_layers = set(s.moe_layers) if s.moe is not None else set()
    # the tasks the checks below walk (all but attention, which is checked in numpy at the end)
    rows_list = table[table[:, OP] != ATTN].tolist()
    has_head = any(t[OP] == LM_HEAD for t in rows_list)
    # (opcode, layer, aux) -> the extent its tiles must cover once; aux: an expert slot (EXPERT_GU)
    want: dict[tuple[int, int, int], int] = {}
    for layer in range(s.num_layers):
        want[(QKV, layer, 0)] = s.heads + 2 * s.kv_heads
        want[(O_PROJ, layer, 0)] = s.hidden
        if layer in moe_layers:
            assert s.moe is not None
            want[(MOE_DOWN, layer, 0)] = s.hidden
            for a in range(expert_slots(s.moe, rows)):
                want[(EXPERT_GU, layer, a)] = s.moe.ffn
            if s.moe.shared_ffn:
                want[(SHARED_GU, layer, 0)] = s.moe.shared_ffn
        else:
            want[(GATE_UP, layer, 0)] = s.ffn
            want[(DOWN, layer, 0)] = s.hidden
    if has_head:
        want[(LM_HEAD, -1, 0)] = s.vocab
    tiled = {QKV, O_PROJ, GATE_UP, DOWN, LM_HEAD, EXPERT_GU, SHARED_GU, MOE_DOWN}
    by_op: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for t in rows_list:
        if t[OP] in tiled:
            key = (t[OP], t[LAYER], t[AUX] if t[OP] == EXPERT_GU else 0)
            if key not in want:
                raise CpuPlanError(f"{OP_NAMES[t[OP]]} task of layer {t[LAYER]} (aux {t[AUX]}) has no place here")
            by_op.setdefault(key, []).append((t[T0], t[T1]))
    for (code, layer, aux), n in want.items():
        spans = sorted(by_op.get((code, layer, aux), []))
        pos = 0
        for a, b in spans:
            if a != pos or b <= a:
                raise CpuPlanError(f"{OP_NAMES[code]} of layer {layer}: tiles {spans} do not cover 0..{n} once")
            if code in (GATE_UP, EXPERT_GU, SHARED_GU) and (a % 32 or (b % 32 and b != n)):
                raise CpuPlanError(f"{OP_NAMES[code]} tiles must start and end on groups of 32, got {a}..{b}")
            pos = b
        if pos != n:
            raise CpuPlanError(f"{OP_NAMES[code]} of layer {layer}: tiles {spans} do not cover 0..{n}")
    routes = [t[LAYER] for t in rows_list if t[OP] == ROUTE]
    if sorted(routes) != sorted(moe_layers):
        raise CpuPlanError(f"one ROUTE task per MoE layer {sorted(moe_layers)}, got {sorted(routes)}")
    # the experts' products read the router's pairs, the DOWN tiles their outputs: ROUTE -> GU -> MOE_DOWN
    ops_of: dict[int, set[int]] = {}
    for t in rows_list:
        ops_of.setdefault(t[SIG_EV], set()).add(t[OP])
    for i, t in enumerate(rows_list):
        if t[OP] in (EXPERT_GU, SHARED_GU, MOE_DOWN):
            producers = ops_of.get(t[WAIT_EV], set())
            need = {ROUTE} if t[OP] != MOE_DOWN else {EXPERT_GU, SHARED_GU}
            if not producers & need:
                raise CpuPlanError(f"task {i} ({OP_NAMES[t[OP]]}) does not wait on {sorted(OP_NAMES[c] for c in need)}")
    # attention: every (layer, row, KV head) once, its tasks the parts 0..n-1 of one count n (1..MAX)
    att = table[table[:, OP] == ATTN].astype(np.int64)
    whole = att[:, T1] == ALL_HEADS   # a task for all of its row's KV heads counts once for each
    spread = np.repeat(att[whole], s.kv_heads, axis=0)
    spread[:, T1] = np.tile(np.arange(s.kv_heads), int(whole.sum()))
    att = np.concatenate([att[~whole], spread])
    keys, first, inverse = np.unique(att[:, [LAYER, T0, T1]], axis=0, return_index=True, return_inverse=True)
    if len(keys) != s.num_layers * rows * s.kv_heads:
        raise CpuPlanError("attention tasks do not cover every (row, KV head) of every layer once")
    inverse = inverse.reshape(-1)
    part, count = att[:, AUX] & 0xFF, att[:, AUX] >> 8
    n_parts = np.maximum(count[first], 1)                      # each key's n, from its first task
    tasks = np.bincount(inverse, minlength=len(keys))
    order = np.lexsort((part, inverse))                     # by key, then part
    starts = np.concatenate([[0], np.cumsum(tasks)[:-1]])
    ok_part = part[order] == np.arange(len(att)) - starts[inverse[order]]
    ok_count = count[order] == count[first][inverse[order]]
    bad_key = (n_parts > MAX_ATTN_PARTS) | (tasks != n_parts)
    np.logical_or.at(bad_key, inverse[order], ~(ok_part & ok_count))
    if bad_key.any():
        k = int(np.flatnonzero(bad_key)[np.argmin(first[bad_key])])   # the first to appear in the table
        got = sorted(zip(part[inverse == k].tolist(), count[inverse == k].tolist()))
        raise CpuPlanError(f"attention of (layer, row, KV head) {tuple(keys[k].tolist())}: tasks {got} are not "
                           f"0..{n_parts[k] - 1} of {n_parts[k]} (at most {MAX_ATTN_PARTS})")
