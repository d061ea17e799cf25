"""The persistent megakernel's Triton code: the whole decode step as ONE launch over a task table.

The runtime side (`slipstream/runtime/megakernel.py`: buffers, launch, the `MegakernelDecoder`)
and the plan (`slipstream/runtime/plan/`: the compiler and the table's format) live above; this
module reads the table's opcodes and columns from `task_table.py` as constexpr values, so the
kernel and the compiler cannot disagree on them.

One Triton program per SM loops: it takes the next task from an atomic ticket counter over the
plan's topological order (so a task only ever waits on tasks that were taken before it, by
programs that are running: no co-residency assumption, and it runs under `TRITON_INTERPRET=1`),
spins until its event reaches the expected count (acquire), runs the task's opcode, and signals
its event (release, after a barrier so every thread's writes are in). Intermediate results stay in
the flat activation buffer (L2-resident at these sizes); no launch separates operators.

Counters are epoch-numbered instead of reset: at step e a wait is satisfied at count * e, and the
ticket counter of step e starts at (e - 1) * (tasks + programs) (every program draws exactly one
ticket past the end). A wait that does not complete within `max_spins` polls sets the error word
(1 + the task's index, unless an earlier failure set it), every other waiting program gives up as
soon as it sees the word, and the kernel drains instead of hanging. A task costs three atomics when
nothing fails: its ticket, one satisfied poll, its signal. The attention splits' signal is an acq_rel
count whose result elects the group's last split, which merges the group's partials (no reduce task,
no poll between the phases: split-K's "last CTA finishes") and signals the next event.

Opcode bodies follow `runtime/vm.py` (the torch executor and reference) exactly.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer  # only called when PROFILE (a GPU)

from slipstream.kernels.triton import task_table as _table

# the task table, as compile-time constants: opcodes ...
EMBED = tl.constexpr(int(_table.Op.EMBED))
QKV_ROPE = tl.constexpr(int(_table.Op.QKV_ROPE))
ATTN_SPLIT = tl.constexpr(int(_table.Op.ATTN_SPLIT))
ATTN_REDUCE = tl.constexpr(int(_table.Op.ATTN_REDUCE))
O_PROJ = tl.constexpr(int(_table.Op.O_PROJ))
GATE_UP = tl.constexpr(int(_table.Op.GATE_UP))
DOWN = tl.constexpr(int(_table.Op.DOWN))
LM_HEAD = tl.constexpr(int(_table.Op.LM_HEAD))
ARGMAX = tl.constexpr(int(_table.Op.ARGMAX))
DOT_M = tl.constexpr(16)   # `_mv_dot`'s padded rows
DOT_TILES = tl.constexpr(True)   # batch 4-8 matvecs on tensor cores (`_mv_dot`) where the tile has >= 16 rows
MV_PRECISION = tl.constexpr("ieee")   # float32 weights (CPU tests): exact; 16-bit weights ignore it
# ... and columns of a row, the row's width and the weights' alignment
C_OP = tl.constexpr(_table.OP)
C_LAYER = tl.constexpr(_table.LAYER)
C_T0 = tl.constexpr(_table.T0)
C_T1 = tl.constexpr(_table.T1)
C_WAIT_EV = tl.constexpr(_table.WAIT_EV)
C_WAIT_COUNT = tl.constexpr(_table.WAIT_COUNT)
C_SIG_EV = tl.constexpr(_table.SIG_EV)
C_W_OFF = tl.constexpr(_table.W_OFF)
C_N_OFF = tl.constexpr(_table.N_OFF)
C_AUX = tl.constexpr(_table.AUX)
NUM_COLS = tl.constexpr(_table.NUM_COLS)
WEIGHT_ALIGN = tl.constexpr(_table.WEIGHT_ALIGN)
# the kernel's `if op == ...` chain ends in an unconditional ARGMAX branch
assert int(_table.Op.ARGMAX) == max(int(o) for o in _table.Op)
assert (_table.Op.O_PROJ, _table.Op.GATE_UP, _table.Op.DOWN, _table.Op.LM_HEAD) == tuple(
    _table.Op(int(_table.Op.O_PROJ) + i) for i in range(4))   # `_prefetch_weights` tests a range


@triton.jit
def _rstd_of(ss_base, offs_b, b_mask, n, K, eps, NT, NT_PAD: tl.constexpr):
    """1 / rms of each row of x from the `n` per-tile sums of squares its producers left at ss_base
    ([B, NT], row stride NT): one load, instead of every consumer task re-reading all of x."""
    offs_t = tl.arange(0, NT_PAD)
    part = tl.load(ss_base + offs_b[:, None] * NT + offs_t[None, :],
                   mask=b_mask[:, None] & (offs_t < n)[None, :], other=0.0, cache_modifier=".cg")
    return 1.0 / tl.sqrt(tl.sum(part, axis=1) / K + eps)


@triton.jit
def _store_sumsq(ss_base, offs_b, b_mask, v, NT, j):
    """Tile j's sum of squares of the finished x values `v` ([B, tile], zero outside it), per row."""
    tl.store(ss_base + offs_b * NT + j, tl.sum(v * v, axis=1), mask=b_mask)


@triton.jit
def _mv_tile(x_base, ROW_STRIDE, offs_b, b_mask, rstd, nw_ptr, w_ptr, row_a, row_b, n_rows, K,
             NORM: tl.constexpr, TWO: tl.constexpr, TILE: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_B: tl.constexpr):
    """(acc_a, acc_b): acc_a[b, j] = sum_k xin[b, k] * W[row_a + j, k] for j < n_rows, and acc_b the
    same at row_b when TWO (gate and up, or the two RoPE halves: both tiles' loads issued together);
    xin = x * rstd * norm_weight when NORM (the fused RMSNorm), else x. Float32 accumulation.
    Batch 1-2: `_mv_wide` (no reduction, conversion or barrier per K-step); batch 4-8: `_mv_dot`
    (tensor cores, the rows padded to 16; Triton pipelines its loads as cp.async), or `_mv_rows` for
    tiles under 16 rows (a [batch, TILE, K-chunk] accumulator would spill, so it reduces every step)."""
    if BLOCK_B >= 4 and TILE >= 16 and DOT_TILES:
        ya, yb = _mv_dot(x_base, ROW_STRIDE, offs_b, b_mask, rstd, nw_ptr, w_ptr, row_a, row_b, n_rows, K,
                         NORM, TWO, TILE, BLOCK_K, BLOCK_B)
    elif BLOCK_B >= 4:
        ya, yb = _mv_rows(x_base, ROW_STRIDE, offs_b, b_mask, rstd, nw_ptr, w_ptr, row_a, row_b, n_rows, K,
                          NORM, TWO, TILE, BLOCK_K, BLOCK_B)
    else:
        ya, yb = _mv_wide(x_base, ROW_STRIDE, offs_b, b_mask, rstd, nw_ptr, w_ptr, row_a, row_b, n_rows, K,
                          NORM, TWO, TILE, BLOCK_K, BLOCK_B)
    return ya, yb


@triton.jit
def _mv_dot(x_base, ROW_STRIDE, offs_b, b_mask, rstd, nw_ptr, w_ptr, row_a, row_b, n_rows, K,
            NORM: tl.constexpr, TWO: tl.constexpr, TILE: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_B: tl.constexpr):
    """`_mv_tile` for several rows on tensor cores: the rows padded to DOT_M = 16 (the smallest `tl.dot`
    tile) times the [K-chunk, TILE] transposed weight chunk, in the weights' dtype with float32
    accumulation (float32 weights: exact products); the first BLOCK_B rows of the result are returned
    and RMSNorm's 1/rms applied to them."""
    n_b = tl.sum(b_mask.to(tl.int32), axis=0)
    m = tl.arange(0, DOT_M)
    j = tl.arange(0, TILE)
    kk = tl.arange(0, BLOCK_K)
    r_mask = j < n_rows
    pa = w_ptr + (row_a + j).to(tl.int64)[None, :] * K + kk[:, None]     # [BLOCK_K, TILE], K contiguous
    pb = w_ptr + (row_b + j).to(tl.int64)[None, :] * K + kk[:, None]
    px = x_base + m[:, None] * ROW_STRIDE + kk[None, :]
    acc_a = tl.zeros((DOT_M, TILE), tl.float32)
    acc_b = tl.zeros((DOT_M, TILE), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + kk < K
        x = tl.load(px + k0, mask=(m < n_b)[:, None] & k_mask[None, :], other=0.0, cache_modifier=".cg")
        if NORM:
            x = x * tl.load(nw_ptr + k0 + kk, mask=k_mask, other=0.0, cache_modifier=".cg").to(tl.float32)[None, :]
        xw = x.to(w_ptr.dtype.element_ty)
        wa = tl.load(pa + k0, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc_a = tl.dot(xw, wa, acc_a, input_precision=MV_PRECISION)
        if TWO:
            wb = tl.load(pb + k0, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            acc_b = tl.dot(xw, wb, acc_b, input_precision=MV_PRECISION)
    # rows [0, BLOCK_B) of the [DOT_M, TILE] results
    sel = (tl.arange(0, DOT_M // BLOCK_B)[:, None, None] == 0)
    ya = tl.sum(tl.where(sel, tl.reshape(acc_a, (DOT_M // BLOCK_B, BLOCK_B, TILE)), 0.0), axis=0)
    yb = tl.sum(tl.where(sel, tl.reshape(acc_b, (DOT_M // BLOCK_B, BLOCK_B, TILE)), 0.0), axis=0)
    if NORM:
        ya = ya * rstd[:, None]
        yb = yb * rstd[:, None]
    return ya, yb


@triton.jit
def _mv_rows(x_base, ROW_STRIDE, offs_b, b_mask, rstd, nw_ptr, w_ptr, row_a, row_b, n_rows, K,
             NORM: tl.constexpr, TWO: tl.constexpr, TILE: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_B: tl.constexpr):
    """`_mv_tile` for several rows: [B, K-chunk] x [TILE, K-chunk] products reduced over K each step."""
    j = tl.arange(0, TILE)
    r_mask = j < n_rows
    ra = (row_a + j).to(tl.int64)
    rb = (row_b + j).to(tl.int64)
    acc_a = tl.zeros((BLOCK_B, TILE), tl.float32)
    acc_b = tl.zeros((BLOCK_B, TILE), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        wm = r_mask[:, None] & k_mask[None, :]
        wa = tl.load(w_ptr + ra[:, None] * K + offs_k[None, :], mask=wm, other=0.0)
        wb = wa
        if TWO:
            wb = tl.load(w_ptr + rb[:, None] * K + offs_k[None, :], mask=wm, other=0.0)
        x = tl.load(x_base + offs_b[:, None] * ROW_STRIDE + offs_k[None, :],
                    mask=b_mask[:, None] & k_mask[None, :], other=0.0, cache_modifier=".cg")
        if NORM:
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            x = x * rstd[:, None] * nw[None, :]
        acc_a += tl.sum(x[:, None, :] * wa.to(tl.float32)[None, :, :], axis=2)
        if TWO:
            acc_b += tl.sum(x[:, None, :] * wb.to(tl.float32)[None, :, :], axis=2)
    return acc_a, acc_b


@triton.jit
def _mv_wide(x_base, ROW_STRIDE, offs_b, b_mask, rstd, nw_ptr, w_ptr, row_a, row_b, n_rows, K,
             NORM: tl.constexpr, TWO: tl.constexpr, TILE: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_B: tl.constexpr):
    """`_mv_tile` at batch 1-2, built for the compiled loop: every operand is a [BLOCK_B, TILE, BLOCK_K]
    tensor of one layout (no layout conversion, so no shared-memory round trip or barrier per K-step),
    products accumulate element-wise and are reduced over K once after the loop (no shuffles per
    K-step), and two K-chunks are loaded per step before either is used (two chunks in flight)."""
    j = tl.arange(0, TILE)[None, :, None]
    kk = tl.arange(0, BLOCK_K)[None, None, :]
    b3 = offs_b[:, None, None]
    bm3 = b_mask[:, None, None]
    r_mask = j < n_rows
    pa = w_ptr + (row_a + j).to(tl.int64) * K + kk
    pb = w_ptr + (row_b + j).to(tl.int64) * K + kk
    acc_a = tl.zeros((BLOCK_B, TILE, BLOCK_K), tl.float32)
    acc_b = tl.zeros((BLOCK_B, TILE, BLOCK_K), tl.float32)
    # x and the norm weight are loaded at the tile's full shape (addresses repeat along TILE): they
    # then share the weights' layout, where a [B, 1, BLOCK_K] load would need a conversion per step
    jz = j * 0
    px = x_base + b3 * ROW_STRIDE + jz + kk
    pn = nw_ptr + jz + kk
    for k0 in range(0, K, 2 * BLOCK_K):
        # two K-chunks per step, every load issued before any is used: two chunks in flight without
        # loop-carried loads (which the compiler repacks, and so waits for, in the issuing step)
        k1 = k0 + BLOCK_K
        m0 = k0 + kk < K
        m1 = k1 + kk < K
        wa0 = tl.load(pa + k0, mask=r_mask & m0, other=0.0)
        wa1 = tl.load(pa + k1, mask=r_mask & m1, other=0.0)
        wb0 = wa0
        wb1 = wa1
        if TWO:
            wb0 = tl.load(pb + k0, mask=r_mask & m0, other=0.0)
            wb1 = tl.load(pb + k1, mask=r_mask & m1, other=0.0)
        x0 = tl.load(px + k0, mask=bm3 & m0, other=0.0, cache_modifier=".cg")
        x1 = tl.load(px + k1, mask=bm3 & m1, other=0.0, cache_modifier=".cg")
        if NORM:
            x0 = x0 * rstd[:, None, None] * tl.load(pn + k0, mask=(jz + k0 + kk) < K, other=0.0,
                                                    cache_modifier=".cg").to(tl.float32)
            x1 = x1 * rstd[:, None, None] * tl.load(pn + k1, mask=(jz + k1 + kk) < K, other=0.0,
                                                    cache_modifier=".cg").to(tl.float32)
        acc_a += x0 * wa0.to(tl.float32) + x1 * wa1.to(tl.float32)
        if TWO:
            acc_b += x0 * wb0.to(tl.float32) + x1 * wb1.to(tl.float32)
    return tl.sum(acc_a, axis=2), tl.sum(acc_b, axis=2)


@triton.jit
def _prefetch_weights(w_base, op, t0, t1, Hd, F, error_ptr, HD: tl.constexpr, D: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """Reads the weight rows a task will multiply (QKV head, O/gate+up/down/LM-head tile) so they
    are in L2 when its dependency arrives. The sum feeds a store that only a weight of exactly
    -3e38 could trigger, so the compiler cannot drop the loads."""
    ROWS: tl.constexpr = 16
    is_mat = (op == QKV_ROPE) | ((op >= O_PROJ) & (op <= LM_HEAD))
    lo = tl.where(op == QKV_ROPE, (t0 // (D // 2)) * D, t0)   # QKV: the whole head of pairs [t0, t1)
    n = tl.where(is_mat, tl.where(op == QKV_ROPE, D, t1 - t0), 0)
    K = tl.where(op == O_PROJ, HD, tl.where(op == DOWN, F, Hd))
    passes = tl.where(op == GATE_UP, 2, 1)    # gate rows, then the matching up rows at F + row
    junk = tl.zeros((ROWS, BLOCK_K), tl.float32)
    for p in range(0, passes):
        base = lo + p * F
        for r0 in range(0, n, ROWS):
            rows = (base + r0 + tl.arange(0, ROWS)).to(tl.int64)
            r_mask = r0 + tl.arange(0, ROWS) < n
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                junk += tl.load(w_base + rows[:, None] * K + ks[None, :], mask=r_mask[:, None] & (ks < K)[None, :],
                                other=0.0).to(tl.float32)
    total = tl.sum(tl.sum(junk, axis=1), axis=0)
    hit = (tl.zeros((1,), tl.float32) + total) == -3.0e38
    tl.store(error_ptr + tl.arange(0, 1), tl.full((1,), -2, tl.int32), mask=hit)


@triton.jit
def _task_row(tasks_ptr, i, num_tasks):
    """Task i's row (op, layer, t0, t1, wait event, wait count, signal event, weight and norm offsets in
    units of WEIGHT_ALIGN: a value carried through the task loop loses `tl.multiple_of`, a product with
    the constant keeps the alignment that lets the weight loads be 16 bytes wide); zeros past the
    table's end or for a negative ticket (the loop then stops before using them)."""
    row = tasks_ptr + i.to(tl.int64) * NUM_COLS
    ok = (i >= 0) & (i < num_tasks)
    return (tl.load(row + C_OP, mask=ok, other=0), tl.load(row + C_LAYER, mask=ok, other=0),
            tl.load(row + C_T0, mask=ok, other=0), tl.load(row + C_T1, mask=ok, other=0),
            tl.load(row + C_WAIT_EV, mask=ok, other=0), tl.load(row + C_WAIT_COUNT, mask=ok, other=0),
            tl.load(row + C_SIG_EV, mask=ok, other=0), tl.load(row + C_W_OFF, mask=ok, other=0) // WEIGHT_ALIGN,
            tl.load(row + C_N_OFF, mask=ok, other=0) // WEIGHT_ALIGN)


@triton.jit(do_not_specialize=["epoch"])   # a new value every step: never a reason to recompile
def _megakernel(tasks_ptr, num_tasks, sync_ptr, num_events, epoch, max_spins, prof_ptr,
                W_ptr, A_ptr, I_ptr, k_ptr, v_ptr, inv_freq_ptr,
                B, num_slots, eps, scale,
                X_OFF, Q_OFF, PACC_OFF, PM_OFF, PL_OFF, ATTN_OFF, ACT_OFF, LOGITS_OFF, LMV_OFF, LMI_OFF, NLM,
                SS_OFF, NT, NT_E, NT_O, NT_D, L,
                TOK_OFF, POS_OFF, SLOT_OFF, CTX_OFF, BT_OFF, NEXT_OFF,
                Hd, F, V, S, MAX_BLOCKS,
                H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
                S_BLOCK: tl.constexpr, P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                T_EMBED: tl.constexpr, T_O: tl.constexpr, T_GU: tl.constexpr, T_DOWN: tl.constexpr,
                T_LM: tl.constexpr, T_QKV: tl.constexpr, BLOCK_V: tl.constexpr, BK_QKV: tl.constexpr,
                BK_O: tl.constexpr, BK_GU: tl.constexpr, BK_DOWN: tl.constexpr, BK_LM: tl.constexpr,
                LM_TILE: tl.constexpr, TILE_E: tl.constexpr, TILE_O: tl.constexpr, TILE_D: tl.constexpr,
                NT_PAD: tl.constexpr,
                PROFILE: tl.constexpr,
                PREFETCH: tl.constexpr, PF_K: tl.constexpr, QM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                TICKET_AHEAD: tl.constexpr, ROW_AHEAD: tl.constexpr):
    nprog = tl.num_programs(0)
    G: tl.constexpr = H // KVH
    HALF: tl.constexpr = D // 2
    queue_ptr = sync_ptr + num_events
    error_ptr = sync_ptr + num_events + 1
    ticket_base = (epoch - 1) * (num_tasks + nprog)
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < B
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, G_PAD)
    g_mask = offs_g < G
    x_base = A_ptr + X_OFF

    # TICKET_AHEAD: tickets are drawn one task ahead: the next ticket's atomic is issued when a task
    # begins (relaxed: it orders nothing; data is ordered by the events' acquire/release), so its round
    # trip overlaps the task instead of preceding the next one. A held ticket is always greater than
    # the holder's running task, so the lowest unfinished ticket is always running: no deadlock.
    if TICKET_AHEAD:
        nxt = tl.atomic_add(queue_ptr, 1, sem="relaxed") - ticket_base
    else:
        nxt = ticket_base * 0
    # ROW_AHEAD (with TICKET_AHEAD): the next task's row is loaded before this task's signal, so its L2
    # round trip overlaps the signal's release fence instead of following it (the first row: here)
    if ROW_AHEAD:
        n_op, n_layer, n_t0, n_t1, n_wait, n_count, n_sig, n_woff, n_noff = _task_row(tasks_ptr, nxt, num_tasks)
    running = True
    while running:
        if TICKET_AHEAD:
            i = nxt
        else:
            i = tl.atomic_add(queue_ptr, 1) - ticket_base
        if i < 0:   # the counter is behind its epoch (a failed step not yet cleared): stop, flag it
            tl.atomic_cas(error_ptr, 0, -1)
            running = False
        elif i >= num_tasks:
            running = False
        else:
            if ROW_AHEAD:
                op, layer, t0, t1, wait_ev = n_op, n_layer, n_t0, n_t1, n_wait
                target = n_count * epoch
                sig_ev = n_sig
                w_off = n_woff * WEIGHT_ALIGN
                n_off = n_noff * WEIGHT_ALIGN
            else:
                row = tasks_ptr + i.to(tl.int64) * NUM_COLS
                op = tl.load(row + C_OP)
                layer = tl.load(row + C_LAYER)
                t0 = tl.load(row + C_T0)
                t1 = tl.load(row + C_T1)
                wait_ev = tl.load(row + C_WAIT_EV)
                target = tl.load(row + C_WAIT_COUNT) * epoch
                sig_ev = tl.load(row + C_SIG_EV)
                w_off = tl.multiple_of(tl.load(row + C_W_OFF), WEIGHT_ALIGN)   # WeightLayout aligns every weight
                n_off = tl.multiple_of(tl.load(row + C_N_OFF), WEIGHT_ALIGN)
            if TICKET_AHEAD:
                nxt = tl.atomic_add(queue_ptr, 1, sem="relaxed") - ticket_base
            if PROFILE:   # the kernel's own timestamps: wait begins, run begins, signal sent
                tl.store(prof_ptr + i.to(tl.int64) * 3, globaltimer())
            # -- wait (acquire), bounded; also gives up when another program has failed ---------
            ok = True
            if wait_ev >= 0:
                seen = tl.atomic_add(sync_ptr + wait_ev, 0, sem="acquire")
                # weights never depend on events: while waiting, read this task's tile into L2
                if PREFETCH == 2:     # the whole tile, always (tests: under the interpreter nothing ever waits)
                    _prefetch_weights(W_ptr + w_off, op, t0, t1, Hd, F, error_ptr, H * D, D, BLOCK_K)
                # PREFETCH == 1: an O_PROJ task reads its tile one [T_O, PF_K] chunk per spin, only while
                # it waits, so it never starts later than one chunk's round trip after its event; once the
                # tile is read it polls in the plain spin loop below. O is the phase that waits while HBM is
                # idle (the attention phase before it reads only the KV); every other phase's waiting
                # programs would take bandwidth from a running one
                spins = 0
                err = 0
                if PREFETCH == 1:
                    pf = 0
                    n_pf = tl.where(op == O_PROJ, tl.cdiv(H * D, PF_K), 0)
                    pf_rows = (t0 + tl.arange(0, T_O)).to(tl.int64)
                    pf_rmask = tl.arange(0, T_O) < t1 - t0
                    junk = tl.zeros((T_O, PF_K), tl.float32)
                    while (seen < target) & (pf < n_pf) & (spins < max_spins) & (err == 0):
                        # the chunk's loads issued before the poll, used after it: both in flight
                        ks = pf * PF_K + tl.arange(0, PF_K)
                        chunk = tl.load(W_ptr + w_off + pf_rows[:, None] * (H * D) + ks[None, :],
                                        mask=pf_rmask[:, None] & (ks < H * D)[None, :], other=0.0)
                        pf += 1
                        seen = tl.atomic_add(sync_ptr + wait_ev, 0, sem="acquire")
                        junk = tl.maximum(junk, chunk.to(tl.float32))
                        if (spins & 63) == 63:
                            err = tl.atomic_add(error_ptr, 0)
                        spins += 1
                    # a use the compiler cannot drop (no bf16 weight is exactly -3e38)
                    hit = (tl.zeros((1,), tl.float32) + tl.max(tl.max(junk, axis=1), axis=0)) == -3.0e38
                    tl.store(error_ptr + tl.arange(0, 1), tl.full((1,), -2, tl.int32), mask=hit)
                while (seen < target) & (spins < max_spins) & (err == 0):
                    seen = tl.atomic_add(sync_ptr + wait_ev, 0, sem="acquire")
                    if (spins & 63) == 63:   # another program's failure: checked rarely (an L2 atomic each)
                        err = tl.atomic_add(error_ptr, 0)
                    spins += 1
                if seen < target:
                    tl.atomic_cas(error_ptr, 0, (i + 1).to(tl.int32))   # the first failure is the cause
                    ok = False
                    running = False
            tl.debug_barrier()
            if PROFILE:
                tl.store(prof_ptr + i.to(tl.int64) * 3 + 1, globaltimer())
            if ok:
                w_base = W_ptr + w_off
                do_signal = op != ATTN_SPLIT
                sig_to = sig_ev
                if op == EMBED:     # x[b, t0:t1] = embed[token[b], t0:t1]
                    cols = t0 + tl.arange(0, T_EMBED)
                    tok = tl.load(I_ptr + TOK_OFF + offs_b, mask=b_mask, other=0)
                    m2 = b_mask[:, None] & (cols < t1)[None, :]
                    e = tl.load(w_base + tok[:, None] * Hd + cols[None, :], mask=m2, other=0.0).to(tl.float32)
                    tl.store(x_base + offs_b[:, None] * Hd + cols[None, :], e, mask=m2)
                    _store_sumsq(A_ptr + SS_OFF, offs_b, b_mask, e, NT, t0 // TILE_E)
                elif op == QKV_ROPE:   # rotation pairs [t0, t1) of one head: norm + QKV rows, rotated, stored
                    rstd = _rstd_of(A_ptr + SS_OFF + 2 * layer * B * NT, offs_b, b_mask,
                                    tl.where(layer == 0, NT_E, NT_D), Hd, eps, NT, NT_PAD)
                    head = t0 // HALF
                    j0 = t0 % HALF
                    r0 = head * D + j0
                    offs_j = j0 + tl.arange(0, T_QKV)
                    j_mask = offs_j < j0 + (t1 - t0)
                    y1, y2 = _mv_tile(x_base, Hd, offs_b, b_mask, rstd, W_ptr + n_off, w_base, r0, r0 + HALF,
                                      t1 - t0, Hd, True, True, T_QKV, BK_QKV, BLOCK_B)
                    slot = tl.load(I_ptr + SLOT_OFF + offs_b, mask=b_mask, other=-1)
                    if head < H + KVH:
                        pos = tl.load(I_ptr + POS_OFF + offs_b, mask=b_mask, other=0).to(tl.float32)
                        freqs = pos[:, None] * tl.load(inv_freq_ptr + offs_j, mask=j_mask, other=0.0)[None, :]
                        cos = tl.cos(freqs)
                        sin = tl.sin(freqs)
                        o1 = y1 * cos - y2 * sin
                        o2 = y2 * cos + y1 * sin
                        if head < H:
                            q_dst = A_ptr + Q_OFF + (offs_b[:, None] * H + head) * D + offs_j[None, :]
                            tl.store(q_dst, o1, mask=b_mask[:, None] & j_mask[None, :])
                            tl.store(q_dst + HALF, o2, mask=b_mask[:, None] & j_mask[None, :])
                        else:
                            k_keep = (b_mask & (slot >= 0))[:, None] & j_mask[None, :]
                            k_dst = k_ptr + ((layer * num_slots + slot) * KVH + (head - H))[:, None] * D + offs_j[None, :]
                            tl.store(k_dst, o1.to(k_ptr.dtype.element_ty), mask=k_keep)
                            tl.store(k_dst + HALF, o2.to(k_ptr.dtype.element_ty), mask=k_keep)
                    else:
                        v_keep = (b_mask & (slot >= 0))[:, None] & j_mask[None, :]
                        v_row = (layer * num_slots + slot) * KVH + (head - H - KVH)
                        v_dst = v_ptr + v_row[:, None] * D + offs_j[None, :]
                        tl.store(v_dst, y1.to(v_ptr.dtype.element_ty), mask=v_keep)
                        tl.store(v_dst + HALF, y2.to(v_ptr.dtype.element_ty), mask=v_keep)
                elif op == ATTN_SPLIT:   # kv head t0, tokens [t1*P, (t1+1)*P) of every sequence
                    # the group's query heads as the M rows of two tensor-core products (padded to QM >= 16
                    # rows, the smallest `tl.dot` tile): scores = q @ K^T, acc += p @ V, in the KV's dtype with
                    # float32 accumulation (float32 KV: exact products, "ieee")
                    offs_m = tl.arange(0, QM)
                    m_mask = offs_m < G
                    lk = k_ptr + layer * num_slots * KVH * D
                    lv = v_ptr + layer * num_slots * KVH * D
                    for b in range(0, B):
                        ctx = tl.load(I_ptr + CTX_OFF + b)
                        start = t1 * P
                        end = tl.minimum(start + P, ctx)
                        q = tl.load(A_ptr + Q_OFF + (b * H + t0 * G + offs_m)[:, None] * D + offs_d[None, :],
                                    mask=m_mask[:, None], other=0.0, cache_modifier=".cg") * scale
                        q = q.to(k_ptr.dtype.element_ty)
                        m = tl.full((QM,), float("-inf"), tl.float32)
                        l = tl.zeros((QM,), tl.float32)
                        acc = tl.zeros((QM, D), tl.float32)
                        for s0 in range(start, end, BLOCK_T):
                            t = s0 + tl.arange(0, BLOCK_T)
                            t_mask = t < end
                            blk = tl.load(I_ptr + BT_OFF + b * MAX_BLOCKS + t // BLOCK_SIZE, mask=t_mask, other=0)
                            kv_row = (blk * BLOCK_SIZE + t % BLOCK_SIZE) * KVH + t0
                            kt = tl.load(lk + kv_row[None, :] * D + offs_d[:, None], mask=t_mask[None, :], other=0.0,
                                         cache_modifier=".cg")      # [D, BLOCK_T]
                            vv = tl.load(lv + kv_row[:, None] * D + offs_d[None, :], mask=t_mask[:, None], other=0.0,
                                         cache_modifier=".cg")      # [BLOCK_T, D]
                            sc = tl.dot(q, kt, input_precision=DOT_PRECISION)
                            sc = tl.where(t_mask[None, :], sc, float("-inf"))
                            m_new = tl.maximum(m, tl.max(sc, axis=1))
                            alpha = tl.exp(m - m_new)
                            p = tl.exp(sc - m_new[:, None])
                            l = l * alpha + tl.sum(p, axis=1)
                            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=DOT_PRECISION)
                            m = m_new
                        part = (b * H + t0 * G + offs_m) * S + t1
                        tl.store(A_ptr + PM_OFF + part, m, mask=m_mask)
                        tl.store(A_ptr + PL_OFF + part, l, mask=m_mask)
                        tl.store(A_ptr + PACC_OFF + (part[:, None] - t1) * D + offs_d[None, :] * S + t1, acc,
                                 mask=m_mask[:, None])   # [B, H, D, S]: splits innermost
                    tl.debug_barrier()
                    # split-K "last CTA finishes": the acq_rel count that releases this split's partials
                    # acquires every earlier split's; the split that completes the count (S per step)
                    # merges its kv group (what an ATTN_REDUCE task did before plan version 3), then
                    # signals the row's AUX event
                    last_split = tl.atomic_add(sync_ptr + sig_ev, 1, sem="acq_rel") == S * epoch - 1
                    do_signal = last_split
                    if last_split:   # ATTN_REDUCE: merge the splits of kv head t0's query heads, S_BLOCK at a time
                        tl.debug_barrier()
                        aux_ev = tl.load(tasks_ptr + i.to(tl.int64) * NUM_COLS + C_AUX)   # loaded here: not live
                                                                                        # across the matvecs
                        # in one pass (a running max rescales what is merged so far). The partials are stored
                        # [B, H, D, S] (splits innermost), so every operand is a [G_PAD, D, S_BLOCK] tensor of one
                        # layout (m and l loaded at that shape, their addresses repeating along D) and the sums
                        # over splits stay within a warp: no layout conversion, no barrier
                        g3 = offs_g[:, None, None]
                        d3 = offs_d[None, :, None]
                        s3 = tl.arange(0, S_BLOCK)[None, None, :]
                        for b in range(0, B):
                            ctx = tl.load(I_ptr + CTX_OFF + b)
                            n_sp = (ctx + P - 1) // P
                            hrow3 = b * H + t0 * G + g3
                            m_run = tl.full((G_PAD, D), -1.0e30, tl.float32)   # finite: no inf - inf
                            num = tl.zeros((G_PAD, D), tl.float32)
                            den = tl.zeros((G_PAD, D), tl.float32)
                            for s0 in range(0, n_sp, S_BLOCK):
                                gs = (g3 < G) & (d3 >= 0) & (s0 + s3 < n_sp)
                                ms = hrow3 * S + s0 + s3 + d3 * 0
                                m = tl.load(A_ptr + PM_OFF + ms, mask=gs, other=float("-inf"), cache_modifier=".cg")
                                l = tl.load(A_ptr + PL_OFF + ms, mask=gs, other=0.0, cache_modifier=".cg")
                                acc = tl.load(A_ptr + PACC_OFF + (hrow3 * D + d3) * S + s0 + s3, mask=gs, other=0.0,
                                              cache_modifier=".cg")
                                m_new = tl.maximum(m_run, tl.max(m, axis=2))
                                alpha = tl.exp(m_run - m_new)
                                w = tl.exp(m - m_new[:, :, None])
                                num = num * alpha + tl.sum(acc * w, axis=2)
                                den = den * alpha + tl.sum(l * w, axis=2)
                                m_run = m_new
                            hrow = b * H + t0 * G + offs_g
                            tl.store(A_ptr + ATTN_OFF + hrow[:, None] * D + offs_d[None, :], num / den, mask=g_mask[:, None])
                        sig_to = aux_ev   # signalled after the opcode chain, as every other task's event
                elif op == O_PROJ:   # x[:, t0:t1] += attn @ Wo[t0:t1]^T
                    acc, _ = _mv_tile(A_ptr + ATTN_OFF, H * D, offs_b, b_mask, offs_b, W_ptr, w_base, t0, t0,
                                      t1 - t0, H * D, False, False, T_O, BK_O, BLOCK_B)
                    cols = t0 + tl.arange(0, T_O)
                    m2 = b_mask[:, None] & (cols < t1)[None, :]
                    dst = x_base + offs_b[:, None] * Hd + cols[None, :]
                    new = tl.load(dst, mask=m2, other=0.0, cache_modifier=".cg") + acc
                    tl.store(dst, new, mask=m2)
                    _store_sumsq(A_ptr + SS_OFF + (2 * layer + 1) * B * NT, offs_b, b_mask, tl.where(m2, new, 0.0),
                                 NT, t0 // TILE_O)
                elif op == GATE_UP:   # act[:, t0:t1] = silu(g) * u of the fused norm + gate/up product
                    rstd = _rstd_of(A_ptr + SS_OFF + (2 * layer + 1) * B * NT, offs_b, b_mask, NT_O, Hd, eps,
                                    NT, NT_PAD)
                    g, u = _mv_tile(x_base, Hd, offs_b, b_mask, rstd, W_ptr + n_off, w_base, t0, F + t0, t1 - t0, Hd,
                                    True, True, T_GU, BK_GU, BLOCK_B)
                    cols = t0 + tl.arange(0, T_GU)
                    m2 = b_mask[:, None] & (cols < t1)[None, :]
                    tl.store(A_ptr + ACT_OFF + offs_b[:, None] * F + cols[None, :], g / (1.0 + tl.exp(-g)) * u, mask=m2)
                elif op == DOWN:   # x[:, t0:t1] += act @ Wdown[t0:t1]^T
                    acc, _ = _mv_tile(A_ptr + ACT_OFF, F, offs_b, b_mask, offs_b, W_ptr, w_base, t0, t0, t1 - t0, F,
                                      False, False, T_DOWN, BK_DOWN, BLOCK_B)
                    cols = t0 + tl.arange(0, T_DOWN)
                    m2 = b_mask[:, None] & (cols < t1)[None, :]
                    dst = x_base + offs_b[:, None] * Hd + cols[None, :]
                    new = tl.load(dst, mask=m2, other=0.0, cache_modifier=".cg") + acc
                    tl.store(dst, new, mask=m2)
                    _store_sumsq(A_ptr + SS_OFF + (2 * layer + 2) * B * NT, offs_b, b_mask, tl.where(m2, new, 0.0),
                                 NT, t0 // TILE_D)
                elif op == LM_HEAD:   # logits[:, t0:t1] of the fused final norm + LM head
                    rstd = _rstd_of(A_ptr + SS_OFF + 2 * L * B * NT, offs_b, b_mask, NT_D, Hd, eps, NT, NT_PAD)
                    acc, _ = _mv_tile(x_base, Hd, offs_b, b_mask, rstd, W_ptr + n_off, w_base, t0, t0, t1 - t0, Hd,
                                      True, False, T_LM, BK_LM, BLOCK_B)
                    cols = t0 + tl.arange(0, T_LM)
                    m2 = b_mask[:, None] & (cols < t1)[None, :]
                    tl.store(A_ptr + LOGITS_OFF + offs_b[:, None] * V + cols[None, :], acc, mask=m2)
                    # this tile's (max, first index) per row: ARGMAX reduces NLM partials, not V logits
                    vals = tl.where(m2, acc, float("-inf"))
                    tmax = tl.max(vals, axis=1)
                    tidx = tl.min(tl.where(vals == tmax[:, None], cols[None, :], V), axis=1)
                    part = offs_b * NLM + t0 // LM_TILE
                    tl.store(A_ptr + LMV_OFF + part, tmax, mask=b_mask)
                    tl.store(A_ptr + LMI_OFF + part, tidx.to(tl.float32), mask=b_mask)
                else:   # ARGMAX (the last opcode): next_tokens[b] = the best LM-head tile partial
                        # (lowest index on ties)
                    for b in range(0, B):
                        best = tl.full((1,), float("-inf"), tl.float32)
                        best_i = tl.zeros((1,), tl.int64)
                        for v0 in range(0, NLM, BLOCK_V):
                            offs_v = v0 + tl.arange(0, BLOCK_V)
                            lg = tl.load(A_ptr + LMV_OFF + b * NLM + offs_v, mask=offs_v < NLM,
                                         other=float("-inf"), cache_modifier=".cg")
                            li = tl.load(A_ptr + LMI_OFF + b * NLM + offs_v, mask=offs_v < NLM,
                                         other=0.0, cache_modifier=".cg")
                            cmax = tl.max(lg, axis=0)
                            cidx = tl.min(tl.where(lg == cmax, li, V), axis=0).to(tl.int64)
                            better = cmax > best
                            best_i = tl.where(better, cidx, best_i)
                            best = tl.where(better, cmax, best)
                        tl.store(I_ptr + NEXT_OFF + b + tl.arange(0, 1), best_i)
                # -- signal (release) once every thread's writes are done -----------------------
                if ROW_AHEAD:   # before the signal: the next row's round trip overlaps the release fence
                    n_op, n_layer, n_t0, n_t1, n_wait, n_count, n_sig, n_woff, n_noff = _task_row(
                        tasks_ptr, nxt, num_tasks)
                if do_signal:   # (an attention split signals in its branch above; the one that merged, here)
                    tl.debug_barrier()
                    tl.atomic_add(sync_ptr + sig_to, 1, sem="release")
                if PROFILE:
                    tl.store(prof_ptr + i.to(tl.int64) * 3 + 2, globaltimer())


def launch_megakernel(num_programs: int, num_warps: int, **args) -> None:
    """The public entry point: one launch of the persistent kernel with `num_programs` programs.
    `args` are the kernel's arguments by name (pointers, scalars and constexprs: see
    `runtime/megakernel.py`'s `scalar_args` and `kernel_constants`)."""
    _megakernel[(num_programs,)](**args, num_warps=num_warps)


def megakernel_function() -> triton.runtime.JITFunction:
    """The kernel's `JITFunction`, for what launches do not cover: its argument names and Triton's
    ahead-of-time compiler (`runtime/megakernel.py`'s `compile_offline`)."""
    return _megakernel


__all__ = ["launch_megakernel", "megakernel_function"]
