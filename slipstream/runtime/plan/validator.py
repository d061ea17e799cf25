"""The static validator of plans: a compiled, loaded or hand-edited plan is checked before it runs.

`validate` checks structure (opcodes, bounds, weight offsets), coverage (every output's tiles
partition its index range), events (counts match, every wait's producers come earlier in the order,
so the persistent kernel cannot deadlock) and data flow (no task can touch a buffer region before
the task that produces it signals, nor overwrite one still being read).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right

import torch

from slipstream.runtime.plan.format import (
    AUX,
    LAYER,
    LAYER_OPS,
    N_OFF,
    NUM_COLS,
    OP,
    SIG_EV,
    T0,
    T1,
    W_OFF,
    WAIT_COUNT,
    WAIT_EV,
    Op,
    Plan,
    PlanError,
    cdiv,
)
from slipstream.runtime.plan.format import task_text as _row_text


def _task_text(i: int, r: list[int]) -> str:
    """A row's text for messages. Rows of `_with_merges` carry their table index (a merge: the index
    of the split row it follows) and whether they are a merge run by the last split of a group."""
    if len(r) > NUM_COLS:
        if r[NUM_COLS + 1]:
            return (f"the merge (ATTN_REDUCE layer {r[LAYER]} [{r[T0]}, {r[T1]})) run by the last split "
                    f"of the group ending at task {r[NUM_COLS]}")
        i = r[NUM_COLS]
    return _row_text(i, r[:NUM_COLS])


def validate(plan: Plan) -> None:
    """Raises PlanError unless the plan is well-formed, its events' counts match, every wait has its
    producers earlier in the order, its tiles cover every output exactly once, and no task can touch a
    buffer region before the task that last wrote (or still reads) it has signalled."""
    if plan.tasks.dim() != 2 or plan.tasks.shape[1] != NUM_COLS or plan.tasks.dtype != torch.int64:
        raise PlanError(f"the task table must be int64 [T, {NUM_COLS}], got {plan.tasks.dtype} "
                        f"{tuple(plan.tasks.shape)}")
    _check_metadata(plan)
    rows = plan.tasks.tolist()
    for i, r in enumerate(rows):
        _check_row(plan, i, r)
    flow = _with_merges(plan, rows)
    _check_coverage(plan, flow)
    _check_events(plan, flow)
    _check_data_flow(plan, flow)


def _with_merges(plan: Plan, rows: list[list[int]]) -> list[list[int]]:
    """The rows with each kv group's merge (an ATTN_REDUCE row, run at run time by whichever of the
    group's splits finishes last) placed after the group's last split in the order: it waits for all
    of the group's splits (their event, whose count is the plan's splits) and signals the splits' AUX
    event. Each row gets two more columns: its table index, and 1 for a merge. Raises PlanError when a
    split event is signalled by anything but the splits of one (layer, kv head) with one AUX event."""
    signallers: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        signallers.setdefault(r[SIG_EV], []).append(i)
    merge_after: dict[int, list[int]] = {}
    for e, idx in signallers.items():
        splits = [i for i in idx if rows[i][OP] == Op.ATTN_SPLIT]
        if not splits:
            continue
        first = rows[splits[0]]
        for i in idx:
            r = rows[i]
            if (r[OP], r[LAYER], r[T0], r[AUX]) != (Op.ATTN_SPLIT, first[LAYER], first[T0], first[AUX]):
                raise PlanError(f"{_task_text(i, r)} signals event '{plan.event_names[e]}' of the splits of layer "
                                f"{first[LAYER]} kv head {first[T0]} (merge event {first[AUX]}): the last split "
                                f"to finish merges one group, so only that group's splits may signal it")
        if len(idx) != plan.splits or plan.event_counts[e] != plan.splits:
            raise PlanError(f"event {e} '{plan.event_names[e]}' of the splits of layer {first[LAYER]} kv head "
                            f"{first[T0]}: {len(idx)} splits signal it, its count is {plan.event_counts[e]}; the "
                            f"kernel elects the merging split at count {plan.splits} (the plan's splits)")
        merge_after[idx[-1]] = [int(Op.ATTN_REDUCE), first[LAYER], first[T0], first[T0] + 1, e, plan.splits,
                                first[AUX], -1, -1, 0, idx[-1], 1]
    out: list[list[int]] = []
    for i, r in enumerate(rows):
        out.append([*r, i, 0])
        if i in merge_after:
            out.append(merge_after[i])
    return out


def _check_metadata(plan: Plan) -> None:
    if plan.num_heads % plan.num_kv_heads:
        raise PlanError(f"{plan.num_heads} heads do not split into {plan.num_kv_heads} kv groups")
    if plan.splits != cdiv(plan.max_context, plan.tiles.partition):
        raise PlanError(f"splits {plan.splits} != cdiv(max_context, partition)")
    if plan.max_blocks != cdiv(plan.max_context, plan.block_size):
        raise PlanError(f"max_blocks {plan.max_blocks} != cdiv(max_context, block_size)")
    if len(plan.event_counts) != len(plan.event_names):
        raise PlanError("event_names and event_counts differ in length")
    if len(plan.weights.layers) != plan.num_layers:
        raise PlanError(f"the weight layout has {len(plan.weights.layers)} layers, the plan {plan.num_layers}")


def _bounds(plan: Plan, op: Op) -> int:
    """The exclusive upper bound of T0..T1 for `op` (ATTN_SPLIT: of T0, the kv head)."""
    H, KVH = plan.num_heads, plan.num_kv_heads
    return {Op.EMBED: plan.hidden_size, Op.QKV_ROPE: (H + 2 * KVH) * (plan.head_dim // 2),    # rotation pairs
            Op.ATTN_SPLIT: KVH, Op.ATTN_REDUCE: KVH,
            Op.O_PROJ: plan.hidden_size, Op.GATE_UP: plan.intermediate_size, Op.DOWN: plan.hidden_size,
            Op.LM_HEAD: plan.vocab_size, Op.ARGMAX: plan.vocab_size}[op]


def _expected_offsets(plan: Plan, op: Op, layer: int) -> tuple[int | None, int | None]:
    """(W_OFF, N_OFF) that a task of `op` in `layer` must carry."""
    wl = plan.weights
    lw = wl.layers[layer] if op in LAYER_OPS else {}
    return {Op.EMBED: (wl.embed, -1), Op.QKV_ROPE: (lw.get("qkv"), lw.get("attn_norm")),
            Op.O_PROJ: (lw.get("o"), -1), Op.GATE_UP: (lw.get("gate_up"), lw.get("ffn_norm")),
            Op.DOWN: (lw.get("down"), -1), Op.LM_HEAD: (wl.lm_head, wl.norm)}.get(op, (-1, -1))


def _check_row(plan: Plan, i: int, r: list[int]) -> None:
    """One row on its own: known opcode, layer and tile range in bounds, events in range, offsets."""
    def fail(why: str) -> PlanError:
        return PlanError(f"{_task_text(i, r)}: {why}")
    if r[OP] not in Op._value2member_map_:
        raise fail(f"unknown opcode {r[OP]}")
    op, n_ev = Op(r[OP]), plan.num_events
    if op in LAYER_OPS and not 0 <= r[LAYER] < plan.num_layers:
        raise fail(f"layer out of range [0, {plan.num_layers})")
    hi = _bounds(plan, op)
    if op == Op.ATTN_SPLIT:
        if not (0 <= r[T0] < hi and 0 <= r[T1] < plan.splits):
            raise fail(f"kv head / split out of range ({hi} kv heads, {plan.splits} splits)")
    elif not 0 <= r[T0] < r[T1] <= hi:
        raise fail(f"empty or out-of-range tile (bound {hi})")
    if op == Op.ATTN_REDUCE:
        raise fail("no ATTN_REDUCE row since plan version 3: the last ATTN_SPLIT of a group to finish merges it")
    half = plan.head_dim // 2
    if op == Op.QKV_ROPE and (r[T0] // half != (r[T1] - 1) // half or r[T1] - r[T0] != half // plan.tiles.qkv_parts):
        raise fail(f"a QKV task covers {half // plan.tiles.qkv_parts} rotation pairs of one head")
    if op == Op.ARGMAX and (r[T0], r[T1]) != (0, plan.vocab_size):
        raise fail("ARGMAX reads the whole vocabulary")
    if not 0 <= r[SIG_EV] < n_ev:
        raise fail(f"signals event {r[SIG_EV]}, out of range [0, {n_ev})")
    if not -1 <= r[WAIT_EV] < n_ev:
        raise fail(f"waits on event {r[WAIT_EV]}, out of range [-1, {n_ev})")
    if r[WAIT_EV] == -1 and r[WAIT_COUNT] != 0:
        raise fail("no wait event but a nonzero wait count")
    if (r[W_OFF], r[N_OFF]) != _expected_offsets(plan, op, r[LAYER]):
        raise fail(f"weight offsets {(r[W_OFF], r[N_OFF])} do not match the weight layout "
                   f"{_expected_offsets(plan, op, r[LAYER])}")
    if op == Op.ATTN_SPLIT:
        if not 0 <= r[AUX] < n_ev:
            raise fail(f"AUX (the event its group's merge signals) {r[AUX]} out of range [0, {n_ev})")
    elif r[AUX] != 0:
        raise fail("AUX is 0 except in ATTN_SPLIT rows")


def _coverage_key(plan: Plan, r: list[int]) -> tuple[tuple, int, int]:
    """(what the task is a tile of, its range in that output's index space)."""
    op = Op(r[OP])
    if op == Op.ATTN_SPLIT:
        return (op, r[LAYER], r[T0]), r[T1], r[T1] + 1    # the splits of one (layer, kv head)
    if op == Op.ARGMAX:
        return (op,), 0, 1
    layer = r[LAYER] if op in LAYER_OPS else -1
    return (op, layer), r[T0], r[T1]


def _expected_outputs(plan: Plan) -> dict[tuple, int]:
    """Every output a step must produce, keyed as in `_coverage_key`, with its size."""
    L, KVH = plan.num_layers, plan.num_kv_heads
    out: dict[tuple, int] = {(Op.EMBED, -1): plan.hidden_size, (Op.LM_HEAD, -1): plan.vocab_size, (Op.ARGMAX,): 1}
    for li in range(L):
        for op in (Op.QKV_ROPE, Op.ATTN_REDUCE, Op.O_PROJ, Op.GATE_UP, Op.DOWN):
            out[(op, li)] = _bounds(plan, op)
        for g in range(KVH):
            out[(Op.ATTN_SPLIT, li, g)] = plan.splits
    return out


def _key_text(key: tuple) -> str:
    op = Op(key[0]).name
    if key[0] == Op.ATTN_SPLIT:
        return f"{op} splits of layer {key[1]} kv head {key[2]}"
    return f"{op}" + (f" of layer {key[1]}" if len(key) > 1 and key[1] >= 0 else "")


def _check_coverage(plan: Plan, rows: list[list[int]]) -> None:
    """The tiles of every output partition its index range: no gap, no overlap, nothing extra."""
    tiles: dict[tuple, list[tuple[int, int, int]]] = {}
    for i, r in enumerate(rows):
        key, lo, hi = _coverage_key(plan, r)
        tiles.setdefault(key, []).append((lo, hi, i))
    expected = _expected_outputs(plan)
    for key, n in expected.items():
        if key not in tiles:
            raise PlanError(f"no {_key_text(key)} task: [0, {n}) uncovered")
        pos, last = 0, -1
        for lo, hi, i in sorted(tiles[key]):
            if lo < pos:
                raise PlanError(f"{_key_text(key)}: [{lo}, {min(hi, pos)}) covered twice, by "
                                f"{_task_text(last, rows[last])} and {_task_text(i, rows[i])}")
            if lo > pos:
                raise PlanError(f"{_key_text(key)}: [{pos}, {lo}) of [0, {n}) is not covered by any task")
            pos, last = hi, i
        if pos != n:
            raise PlanError(f"{_key_text(key)}: [{pos}, {n}) of [0, {n}) is not covered by any task")


def _check_events(plan: Plan, rows: list[list[int]]) -> None:
    """Counts match (signallers per event, and every wait is for the full count), and every wait has
    all its producers earlier in the order (so the persistent kernel cannot deadlock)."""
    signallers: list[list[int]] = [[] for _ in plan.event_names]
    for i, r in enumerate(rows):
        signallers[r[SIG_EV]].append(i)
    for e, (name, count) in enumerate(zip(plan.event_names, plan.event_counts)):
        if len(signallers[e]) != count:
            raise PlanError(f"event {e} '{name}' expects {count} signals per step but "
                            f"{len(signallers[e])} tasks signal it")
    for i, r in enumerate(rows):
        e = r[WAIT_EV]
        if e < 0:
            continue
        name = plan.event_names[e]
        if r[WAIT_COUNT] != plan.event_counts[e]:
            raise PlanError(f"{_task_text(i, r)} waits for {r[WAIT_COUNT]} signals of event '{name}', "
                            f"which receives {plan.event_counts[e]} per step")
        if signallers[e] and signallers[e][-1] >= i:
            j = next(j for j in signallers[e] if j >= i)
            raise PlanError(f"{_task_text(i, r)} waits on event '{name}' but its producer "
                            f"{_task_text(j, rows[j])} is not earlier in the order")


class _Region:
    """The accesses to one buffer region so far, as segments of its index range: each segment's last
    writer (a task index or -1) and the bitset of tasks that read it since. Reads are folded into the
    segments lazily, so a run of tasks reading the same range (all GATE_UP tiles reading x) costs one
    update, not one per segment."""

    def __init__(self, size: int):
        self.starts = [0, size]     # segment i is [starts[i], starts[i+1])
        self.writer = [-1]
        self.readers = [0]
        self.pending: list[list[int]] = []     # [lo, hi, reader bits] not yet in the segments
        self.memo: dict[tuple[int, int], int] = {}   # (lo, hi) -> bits of its last writers

    def _split(self, p: int) -> int:
        idx = bisect_left(self.starts, p)
        if self.starts[idx] != p:
            self.starts.insert(idx, p)
            self.writer.insert(idx, self.writer[idx - 1])
            self.readers.insert(idx, self.readers[idx - 1])
        return idx

    def writers(self, lo: int, hi: int) -> int:
        """The bitset of the last writers of any part of [lo, hi)."""
        bits = self.memo.get((lo, hi))
        if bits is None:
            bits = 0
            for j in range(bisect_right(self.starts, lo) - 1, bisect_left(self.starts, hi)):
                if self.writer[j] >= 0:
                    bits |= 1 << self.writer[j]
            self.memo[(lo, hi)] = bits
        return bits

    def read(self, lo: int, hi: int, task: int) -> None:
        if self.pending and self.pending[-1][0] == lo and self.pending[-1][1] == hi:
            self.pending[-1][2] |= 1 << task
        else:
            self.pending.append([lo, hi, 1 << task])

    def write(self, lo: int, hi: int, task: int) -> tuple[int, int]:
        """Records a write; returns (bits of the previous writers, bits of the readers since) of [lo, hi)."""
        for plo, phi, bits in self.pending:
            for j in range(self._split(plo), self._split(phi)):
                self.readers[j] |= bits
        self.pending.clear()
        i0, i1 = self._split(lo), self._split(hi)
        writers = readers = 0
        for j in range(i0, i1):
            if self.writer[j] >= 0:
                writers |= 1 << self.writer[j]
            readers |= self.readers[j]
        self.starts[i0:i1], self.writer[i0:i1], self.readers[i0:i1] = [lo], [task], [0]
        self.memo.clear()
        return writers, readers


def _accesses(plan: Plan, r: list[int]) -> tuple[list[tuple[tuple, int, int]], list[tuple[tuple, int, int]]]:
    """(reads, writes) of one task as (region, lo, hi), derived from the row alone. Regions: x by
    hidden column, q and attn by head, the KV cache by (layer, kv head), the attention partials by
    group * S + split, act by F column, logits by vocab row. Weights and step inputs are read-only."""
    op, li, t0, t1 = Op(r[OP]), r[LAYER], r[T0], r[T1]
    H, KVH, G, S = plan.num_heads, plan.num_kv_heads, plan.group, plan.splits
    Hd, F, V = plan.hidden_size, plan.intermediate_size, plan.vocab_size
    half = plan.head_dim // 2
    x = ("x",)
    def ss(slot: int) -> tuple:
        return ("sumsq", slot)
    if op == Op.EMBED:
        return [], [(x, t0, t1), (ss(0), t0 // plan.tiles.embed, t0 // plan.tiles.embed + 1)]
    if op == Op.QKV_ROPE:    # q, k and v by rotation pair (head * D/2 + j): pairs [t0, t1) of one head
        out: tuple[tuple, int, int]
        if t0 < H * half:
            out = (("q",), t0, t1)
        elif t0 < (H + KVH) * half:
            out = (("k", li), t0 - H * half, t1 - H * half)
        else:
            out = (("v", li), t0 - (H + KVH) * half, t1 - (H + KVH) * half)
        return [(x, 0, Hd), (ss(2 * li), 0, plan.norm_producers(2 * li))], [out]
    if op == Op.ATTN_SPLIT:
        g, s = t0, t1
        return ([(("q",), g * G * half, (g + 1) * G * half), (("k", li), g * half, (g + 1) * half),
                 (("v", li), g * half, (g + 1) * half)],
                [(("part",), g * S + s, g * S + s + 1)])
    if op == Op.ATTN_REDUCE:
        return [(("part",), t0 * S, (t0 + 1) * S)], [(("attn",), t0 * G, (t0 + 1) * G)]
    if op == Op.O_PROJ:
        j = t0 // plan.tiles.o
        return [(("attn",), 0, H), (x, t0, t1)], [(x, t0, t1), (ss(2 * li + 1), j, j + 1)]
    if op == Op.GATE_UP:
        return [(x, 0, Hd), (ss(2 * li + 1), 0, plan.norm_producers(2 * li + 1))], [(("act",), t0, t1)]
    if op == Op.DOWN:
        j = t0 // plan.tiles.down
        return [(("act",), 0, F), (x, t0, t1)], [(x, t0, t1), (ss(2 * li + 2), j, j + 1)]
    if op == Op.LM_HEAD:
        last = 2 * plan.num_layers
        return ([(x, 0, Hd), (ss(last), 0, plan.norm_producers(last))],
                [(("logits",), t0, t1), (("lm_part",), t0, t1)])
    return [(("lm_part",), 0, V)], [(("next_tokens",), 0, 1)]


def _region_size(plan: Plan, key: tuple) -> int:
    half = plan.head_dim // 2
    return {"x": plan.hidden_size, "q": plan.num_heads * half, "k": plan.num_kv_heads * half,
            "v": plan.num_kv_heads * half,
            "part": plan.num_kv_heads * plan.splits, "attn": plan.num_heads, "act": plan.intermediate_size,
            "logits": plan.vocab_size, "lm_part": plan.vocab_size, "next_tokens": 1,
            "sumsq": plan.norm_producers(key[1]) if key[0] == "sumsq" else 0}[key[0]]


def _region_text(key: tuple, lo: int, hi: int) -> str:
    name = key[0] + (f"[layer {key[1]}]" if len(key) > 1 else "")
    return f"{name}[{lo}:{hi}]"


def _lowest(bits: int) -> int:
    return (bits & -bits).bit_length() - 1


def _happens_before(plan: Plan, rows: list[list[int]]) -> list[int]:
    """Per task, the bitset of tasks that happen before it: a task waiting on event e happens after
    every signaller of e and, transitively, everything before them. Tasks waiting on one event share
    one int, so memory grows with the number of events, not tasks squared."""
    at_event = [0] * plan.num_events
    before = [0] * len(rows)
    for i, r in enumerate(rows):
        hb = at_event[r[WAIT_EV]] if r[WAIT_EV] >= 0 else 0
        before[i] = hb
        at_event[r[SIG_EV]] |= hb | (1 << i)
    return before


def _check_data_flow(plan: Plan, rows: list[list[int]]) -> None:
    """No task reads a buffer region before its producer signals, nor overwrites one that an earlier
    task may still read or write: for every conflicting pair the earlier must happen before the later.
    Checking against the last writer and the readers since is enough, as happens-before is transitive."""
    before = _happens_before(plan, rows)
    regions: dict[tuple, _Region] = {}

    def region(key: tuple) -> _Region:
        if key not in regions:
            regions[key] = _Region(_region_size(plan, key))
        return regions[key]
    for i, r in enumerate(rows):
        reads, writes = _accesses(plan, r)
        ok = before[i] | (1 << i)
        for key, lo, hi in reads:
            bad = region(key).writers(lo, hi) & ~ok
            if bad:
                j = _lowest(bad)
                raise PlanError(f"{_task_text(i, r)} reads {_region_text(key, lo, hi)} before its producer "
                                f"{_task_text(j, rows[j])} signals (no chain of events orders them)")
            region(key).read(lo, hi, i)
        for key, lo, hi in writes:
            writers, readers = region(key).write(lo, hi, i)
            for bits, verb in ((writers, "writes"), (readers, "reads")):
                bad = bits & ~ok
                if bad:
                    j = _lowest(bad)
                    raise PlanError(f"{_task_text(i, r)} writes {_region_text(key, lo, hi)} while "
                                    f"{_task_text(j, rows[j])}, which {verb} it, may still be running "
                                    f"(no chain of events orders them)")
