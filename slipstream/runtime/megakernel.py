"""The persistent megakernel: the whole decode step as ONE launch that runs a compiled task plan.

`plan.py` lowers the step into tile-level tasks in topological order, each waiting on an event
counter and signalling one. Here one Triton program per SM loops: it takes the next task from an
atomic ticket counter over that order (so a task only ever waits on tasks that were taken before
it, by programs that are running: no co-residency assumption, and it runs under
`TRITON_INTERPRET=1`), spins until its event reaches the expected count (acquire), runs the task's
opcode, and signals its event (release, after a barrier so every thread's writes are in).
Intermediate results stay in the flat activation buffer (L2-resident at these sizes); no launch
separates operators.

Counters are epoch-numbered instead of reset: at step e a wait is satisfied at count * e, and the
ticket counter of step e starts at (e - 1) * (tasks + programs) (every program draws exactly one
ticket past the end). A wait that does not complete within `max_spins` polls sets the error word
(1 + the task's index, unless an earlier failure set it), every other waiting program gives up as
soon as it sees the word, and the kernel drains instead of hanging; the host raises `MegakernelError`.
A task costs three atomics when nothing fails: its ticket, one satisfied poll, its signal.

Opcode bodies follow `vm.py` (the torch executor and reference) exactly; see `plan.py` for the
task table and the buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer  # only called when PROFILE (a GPU)

from slipstream.kv.blocks import PagedKVCache
from slipstream.models.llama import LlamaModel
from slipstream.runtime.buckets import BucketedDecoder
from slipstream.runtime.plan import (
    Op,
    Plan,
    TileConfig,
    compile_plan,
    default_tiles,
    fill_inputs,
    new_buffers,
    pack_weights,
    share_weights,
    supports,
    validate,
)
from slipstream.step import StepInput


class MegakernelError(RuntimeError):
    """A task waited longer than its bound for an event: a broken plan or a lost signal."""


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
    Batch 1-2: `_mv_wide` (no reduction, conversion or barrier per K-step); batch 4-8: `_mv_rows`
    (a [batch, TILE, K-chunk] accumulator would spill there, so it reduces over K every step)."""
    if BLOCK_B >= 4:
        ya, yb = _mv_rows(x_base, ROW_STRIDE, offs_b, b_mask, rstd, nw_ptr, w_ptr, row_a, row_b, n_rows, K,
                          NORM, TWO, TILE, BLOCK_K, BLOCK_B)
    else:
        ya, yb = _mv_wide(x_base, ROW_STRIDE, offs_b, b_mask, rstd, nw_ptr, w_ptr, row_a, row_b, n_rows, K,
                          NORM, TWO, TILE, BLOCK_K, BLOCK_B)
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
    is_mat = (op == 1) | ((op >= 4) & (op <= 7))
    lo = tl.where(op == 1, t0 * D, t0)
    n = tl.where(is_mat, tl.where(op == 1, D, t1 - t0), 0)
    K = tl.where(op == 4, HD, tl.where(op == 6, F, Hd))
    passes = tl.where(op == 5, 2, 1)    # gate rows, then the matching up rows at F + row
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
                T_LM: tl.constexpr, BLOCK_V: tl.constexpr, BK_QKV: tl.constexpr,
                BK_O: tl.constexpr, BK_GU: tl.constexpr, BK_DOWN: tl.constexpr, BK_LM: tl.constexpr,
                LM_TILE: tl.constexpr, TILE_E: tl.constexpr, TILE_O: tl.constexpr, TILE_D: tl.constexpr,
                NT_PAD: tl.constexpr,
                PROFILE: tl.constexpr,
                PREFETCH: tl.constexpr):
    nprog = tl.num_programs(0)
    G: tl.constexpr = H // KVH
    HALF: tl.constexpr = D // 2
    queue_ptr = sync_ptr + num_events
    error_ptr = sync_ptr + num_events + 1
    ticket_base = (epoch - 1) * (num_tasks + nprog)
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < B
    offs_d = tl.arange(0, D)
    offs_h = tl.arange(0, HALF)
    offs_g = tl.arange(0, G_PAD)
    g_mask = offs_g < G
    x_base = A_ptr + X_OFF

    running = True
    while running:
        i = tl.atomic_add(queue_ptr, 1) - ticket_base
        if i < 0:   # the counter is behind its epoch (a failed step not yet cleared): stop, flag it
            tl.atomic_cas(error_ptr, 0, -1)
            running = False
        elif i >= num_tasks:
            running = False
        else:
            row = tasks_ptr + i.to(tl.int64) * 10
            op = tl.load(row + 0)
            layer = tl.load(row + 1)
            t0 = tl.load(row + 2)
            t1 = tl.load(row + 3)
            wait_ev = tl.load(row + 4)
            target = tl.load(row + 5) * epoch
            sig_ev = tl.load(row + 6)
            w_off = tl.multiple_of(tl.load(row + 7), 16)   # WeightLayout aligns every weight
            n_off = tl.multiple_of(tl.load(row + 8), 16)
            if PROFILE:   # the kernel's own timestamps: wait begins, run begins, signal sent
                tl.store(prof_ptr + i.to(tl.int64) * 3, globaltimer())
            # -- wait (acquire), bounded; also gives up when another program has failed ---------
            ok = True
            if wait_ev >= 0:
                seen = tl.atomic_add(sync_ptr + wait_ev, 0, sem="acquire")
                # weights never depend on events: while waiting, stream this task's tile into L2
                if PREFETCH == 2:     # always (tests: under the interpreter nothing ever waits)
                    _prefetch_weights(W_ptr + w_off, op, t0, t1, Hd, F, error_ptr, H * D, D, BLOCK_K)
                elif PREFETCH == 1:
                    if seen < target:
                        _prefetch_weights(W_ptr + w_off, op, t0, t1, Hd, F, error_ptr, H * D, D, BLOCK_K)
                spins = 0
                err = 0
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
                if op == 0:     # EMBED: x[b, t0:t1] = embed[token[b], t0:t1]
                    cols = t0 + tl.arange(0, T_EMBED)
                    tok = tl.load(I_ptr + TOK_OFF + offs_b, mask=b_mask, other=0)
                    m2 = b_mask[:, None] & (cols < t1)[None, :]
                    e = tl.load(w_base + tok[:, None] * Hd + cols[None, :], mask=m2, other=0.0).to(tl.float32)
                    tl.store(x_base + offs_b[:, None] * Hd + cols[None, :], e, mask=m2)
                    _store_sumsq(A_ptr + SS_OFF, offs_b, b_mask, e, NT, t0 // TILE_E)
                elif op == 1:   # QKV_ROPE: one head of the fused norm + QKV product, rotated, stored
                    rstd = _rstd_of(A_ptr + SS_OFF + 2 * layer * B * NT, offs_b, b_mask,
                                    tl.where(layer == 0, NT_E, NT_D), Hd, eps, NT, NT_PAD)
                    r0 = t0 * D
                    y1, y2 = _mv_tile(x_base, Hd, offs_b, b_mask, rstd, W_ptr + n_off, w_base, r0, r0 + HALF, HALF,
                                      Hd, True, True, HALF, BK_QKV, BLOCK_B)
                    slot = tl.load(I_ptr + SLOT_OFF + offs_b, mask=b_mask, other=-1)
                    if t0 < H + KVH:
                        pos = tl.load(I_ptr + POS_OFF + offs_b, mask=b_mask, other=0).to(tl.float32)
                        freqs = pos[:, None] * tl.load(inv_freq_ptr + offs_h)[None, :]
                        cos = tl.cos(freqs)
                        sin = tl.sin(freqs)
                        o1 = y1 * cos - y2 * sin
                        o2 = y2 * cos + y1 * sin
                        if t0 < H:
                            q_dst = A_ptr + Q_OFF + (offs_b[:, None] * H + t0) * D + offs_h[None, :]
                            tl.store(q_dst, o1, mask=b_mask[:, None])
                            tl.store(q_dst + HALF, o2, mask=b_mask[:, None])
                        else:
                            k_keep = (b_mask & (slot >= 0))[:, None]
                            k_dst = k_ptr + ((layer * num_slots + slot) * KVH + (t0 - H))[:, None] * D + offs_h[None, :]
                            tl.store(k_dst, o1.to(k_ptr.dtype.element_ty), mask=k_keep)
                            tl.store(k_dst + HALF, o2.to(k_ptr.dtype.element_ty), mask=k_keep)
                    else:
                        v_keep = (b_mask & (slot >= 0))[:, None]
                        v_row = (layer * num_slots + slot) * KVH + (t0 - H - KVH)
                        v_dst = v_ptr + v_row[:, None] * D + offs_h[None, :]
                        tl.store(v_dst, y1.to(v_ptr.dtype.element_ty), mask=v_keep)
                        tl.store(v_dst + HALF, y2.to(v_ptr.dtype.element_ty), mask=v_keep)
                elif op == 2:   # ATTN_SPLIT: kv head t0, tokens [t1*P, (t1+1)*P) of every sequence
                    heads = t0 * G + offs_g
                    lk = k_ptr + layer * num_slots * KVH * D
                    lv = v_ptr + layer * num_slots * KVH * D
                    for b in range(0, B):
                        ctx = tl.load(I_ptr + CTX_OFF + b)
                        start = t1 * P
                        end = tl.minimum(start + P, ctx)
                        q = tl.load(A_ptr + Q_OFF + (b * H + heads)[:, None] * D + offs_d[None, :],
                                    mask=g_mask[:, None], other=0.0, cache_modifier=".cg") * scale
                        m = tl.full((G_PAD,), float("-inf"), tl.float32)
                        l = tl.zeros((G_PAD,), tl.float32)
                        acc = tl.zeros((G_PAD, D), tl.float32)
                        for s0 in range(start, end, BLOCK_T):
                            t = s0 + tl.arange(0, BLOCK_T)
                            t_mask = t < end
                            blk = tl.load(I_ptr + BT_OFF + b * MAX_BLOCKS + t // BLOCK_SIZE, mask=t_mask, other=0)
                            kv_off = ((blk * BLOCK_SIZE + t % BLOCK_SIZE) * KVH + t0)[:, None] * D + offs_d[None, :]
                            kk = tl.load(lk + kv_off, mask=t_mask[:, None], other=0.0,
                                         cache_modifier=".cg").to(tl.float32)
                            vv = tl.load(lv + kv_off, mask=t_mask[:, None], other=0.0,
                                         cache_modifier=".cg").to(tl.float32)
                            sc = tl.sum(q[:, None, :] * kk[None, :, :], axis=2)
                            sc = tl.where(t_mask[None, :], sc, float("-inf"))
                            m_new = tl.maximum(m, tl.max(sc, axis=1))
                            alpha = tl.exp(m - m_new)
                            p = tl.exp(sc - m_new[:, None])
                            l = l * alpha + tl.sum(p, axis=1)
                            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vv[None, :, :], axis=1)
                            m = m_new
                        part = (b * H + heads) * S + t1
                        tl.store(A_ptr + PM_OFF + part, m, mask=g_mask)
                        tl.store(A_ptr + PL_OFF + part, l, mask=g_mask)
                        tl.store(A_ptr + PACC_OFF + part[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])
                elif op == 3:   # ATTN_REDUCE: merge the splits of kv head t0's query heads,
                    heads = t0 * G + offs_g   # S_BLOCK at a time (two passes: max, then sums)
                    offs_s = tl.arange(0, S_BLOCK)
                    for b in range(0, B):
                        ctx = tl.load(I_ptr + CTX_OFF + b)
                        n_sp = (ctx + P - 1) // P
                        m_run = tl.full((G_PAD, S_BLOCK), float("-inf"), tl.float32)
                        for s0 in range(0, n_sp, S_BLOCK):
                            gs = g_mask[:, None] & (s0 + offs_s < n_sp)[None, :]
                            part = (b * H + heads)[:, None] * S + s0 + offs_s[None, :]
                            m_run = tl.maximum(m_run, tl.load(A_ptr + PM_OFF + part, mask=gs, other=float("-inf"),
                                                              cache_modifier=".cg"))
                        m_all = tl.where(g_mask, tl.max(m_run, axis=1), 0.0)
                        num = tl.zeros((G_PAD, D), tl.float32)
                        den = tl.zeros((G_PAD, S_BLOCK), tl.float32)
                        for s0 in range(0, n_sp, S_BLOCK):
                            gs = g_mask[:, None] & (s0 + offs_s < n_sp)[None, :]
                            part = (b * H + heads)[:, None] * S + s0 + offs_s[None, :]
                            m = tl.load(A_ptr + PM_OFF + part, mask=gs, other=float("-inf"), cache_modifier=".cg")
                            l = tl.load(A_ptr + PL_OFF + part, mask=gs, other=0.0, cache_modifier=".cg")
                            w = tl.where(gs, tl.exp(m - m_all[:, None]), 0.0)
                            acc = tl.load(A_ptr + PACC_OFF + part[:, :, None] * D + offs_d[None, None, :],
                                          mask=gs[:, :, None], other=0.0, cache_modifier=".cg")
                            num += tl.sum(acc * w[:, :, None], axis=1)
                            den += l * w
                        d = tl.where(g_mask, tl.sum(den, axis=1), 1.0)
                        tl.store(A_ptr + ATTN_OFF + (b * H + heads)[:, None] * D + offs_d[None, :], num / d[:, None],
                                 mask=g_mask[:, None])
                elif op == 4:   # O_PROJ: x[:, t0:t1] += attn @ Wo[t0:t1]^T
                    acc, _ = _mv_tile(A_ptr + ATTN_OFF, H * D, offs_b, b_mask, offs_b, W_ptr, w_base, t0, t0,
                                      t1 - t0, H * D, False, False, T_O, BK_O, BLOCK_B)
                    cols = t0 + tl.arange(0, T_O)
                    m2 = b_mask[:, None] & (cols < t1)[None, :]
                    dst = x_base + offs_b[:, None] * Hd + cols[None, :]
                    new = tl.load(dst, mask=m2, other=0.0, cache_modifier=".cg") + acc
                    tl.store(dst, new, mask=m2)
                    _store_sumsq(A_ptr + SS_OFF + (2 * layer + 1) * B * NT, offs_b, b_mask, tl.where(m2, new, 0.0),
                                 NT, t0 // TILE_O)
                elif op == 5:   # GATE_UP: act[:, t0:t1] = silu(g) * u of the fused norm + gate/up product
                    rstd = _rstd_of(A_ptr + SS_OFF + (2 * layer + 1) * B * NT, offs_b, b_mask, NT_O, Hd, eps,
                                    NT, NT_PAD)
                    g, u = _mv_tile(x_base, Hd, offs_b, b_mask, rstd, W_ptr + n_off, w_base, t0, F + t0, t1 - t0, Hd,
                                    True, True, T_GU, BK_GU, BLOCK_B)
                    cols = t0 + tl.arange(0, T_GU)
                    m2 = b_mask[:, None] & (cols < t1)[None, :]
                    tl.store(A_ptr + ACT_OFF + offs_b[:, None] * F + cols[None, :], g / (1.0 + tl.exp(-g)) * u, mask=m2)
                elif op == 6:   # DOWN: x[:, t0:t1] += act @ Wdown[t0:t1]^T
                    acc, _ = _mv_tile(A_ptr + ACT_OFF, F, offs_b, b_mask, offs_b, W_ptr, w_base, t0, t0, t1 - t0, F,
                                      False, False, T_DOWN, BK_DOWN, BLOCK_B)
                    cols = t0 + tl.arange(0, T_DOWN)
                    m2 = b_mask[:, None] & (cols < t1)[None, :]
                    dst = x_base + offs_b[:, None] * Hd + cols[None, :]
                    new = tl.load(dst, mask=m2, other=0.0, cache_modifier=".cg") + acc
                    tl.store(dst, new, mask=m2)
                    _store_sumsq(A_ptr + SS_OFF + (2 * layer + 2) * B * NT, offs_b, b_mask, tl.where(m2, new, 0.0),
                                 NT, t0 // TILE_D)
                elif op == 7:   # LM_HEAD: logits[:, t0:t1] of the fused final norm + LM head
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
                else:           # ARGMAX: next_tokens[b] = the best LM-head tile partial (lowest index on ties)
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
                tl.debug_barrier()
                tl.atomic_add(sync_ptr + sig_ev, 1, sem="release")
                if PROFILE:
                    tl.store(prof_ptr + i.to(tl.int64) * 3 + 2, globaltimer())


@dataclass
class _Static:
    """One batch bucket: its plan and buffers; tokens/positions/... are views into the int buffer."""
    plan: Plan
    A: torch.Tensor
    I: torch.Tensor
    sync: torch.Tensor          # int32 [events + 2]: event counters, the ticket counter, the error word
    tasks: torch.Tensor
    epoch: int = 0

    def reset(self) -> None:
        """Zero every counter: the next launch is epoch 1."""
        self.sync.zero_()
        self.epoch = 0

    def _ints(self, off: int, n: int) -> torch.Tensor:
        return self.I[off:off + n]

    @property
    def batch(self) -> int:
        return self.plan.batch

    @property
    def tokens(self) -> torch.Tensor:
        return self._ints(self.plan.ints.tokens, self.batch)

    @property
    def positions(self) -> torch.Tensor:
        return self._ints(self.plan.ints.positions, self.batch)

    @property
    def slots(self) -> torch.Tensor:
        return self._ints(self.plan.ints.write_slots, self.batch)

    @property
    def context(self) -> torch.Tensor:
        return self._ints(self.plan.ints.context_lens, self.batch)

    @property
    def next_tokens(self) -> torch.Tensor:
        return self._ints(self.plan.ints.next_tokens, self.batch)

    @property
    def logits(self) -> torch.Tensor:
        a = self.plan.acts.logits
        return self.A[a:a + self.batch * self.plan.vocab_size].view(self.batch, self.plan.vocab_size)


def _pow2(n: int) -> int:
    return max(triton.next_power_of_2(int(n)), 1)


def launch(s: _Static, W: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inv_freq: torch.Tensor,
           num_programs: int, max_spins: int = 1 << 22, block_k: int | None = None, num_warps: int = 8,
           profile: torch.Tensor | None = None, prefetch: int = 0) -> None:
    """One step: one launch of the persistent kernel over `s.plan` (no host synchronisation).
    With `profile` (int64 [tasks, 3], GPU only) the kernel records per task when its wait began,
    when its work began and when it signalled (`profile_summary` turns that into a breakdown)."""
    p = s.plan
    if s.epoch >= epoch_limit(p, num_programs):
        s.reset()
    epoch = s.epoch + 1
    ptrs = dict(tasks_ptr=s.tasks, sync_ptr=s.sync, prof_ptr=profile if profile is not None else s.sync,
                W_ptr=W, A_ptr=s.A, I_ptr=s.I, k_ptr=k, v_ptr=v, inv_freq_ptr=inv_freq)
    _megakernel[(num_programs,)](**ptrs, **scalar_args(p, k.shape[1], epoch, max_spins),
                                 **kernel_constants(p, block_k), PROFILE=profile is not None, PREFETCH=prefetch,
                                 num_warps=num_warps)
    s.epoch = epoch   # only once launched: a launch that raised must not advance the ticket base


def epoch_limit(p: Plan, num_programs: int) -> int:
    """Steps before the counters are re-zeroed, so that (tasks + programs) * epoch stays in int32."""
    return max(1, (2**31 - 1) // (p.num_tasks + num_programs) - 1)


def scalar_args(p: Plan, num_slots: int, epoch: int = 1, max_spins: int = 1 << 22) -> dict[str, int | float]:
    """The kernel's runtime scalars for a plan: counts, buffer offsets, dimensions."""
    a, n = p.acts, p.ints
    return dict(num_tasks=p.num_tasks, num_events=p.num_events, epoch=epoch, max_spins=max_spins,
                B=p.batch, num_slots=num_slots, eps=float(p.rms_norm_eps), scale=1.0 / math.sqrt(p.head_dim),
                X_OFF=a.x, Q_OFF=a.q, PACC_OFF=a.part_acc, PM_OFF=a.part_m, PL_OFF=a.part_l, ATTN_OFF=a.attn,
                ACT_OFF=a.act, LOGITS_OFF=a.logits, LMV_OFF=a.lm_max, LMI_OFF=a.lm_idx, NLM=p.lm_tiles,
                SS_OFF=a.sumsq, NT=p.norm_tiles, NT_E=p.norm_producers(0), NT_O=p.norm_producers(1),
                NT_D=p.norm_producers(2), L=p.num_layers,
                TOK_OFF=n.tokens, POS_OFF=n.positions, SLOT_OFF=n.write_slots,
                CTX_OFF=n.context_lens, BT_OFF=n.block_tables, NEXT_OFF=n.next_tokens,
                Hd=p.hidden_size, F=p.intermediate_size, V=p.vocab_size, S=p.splits, MAX_BLOCKS=p.max_blocks)


def kernel_constants(p: Plan, block_k: int | None = None) -> dict[str, int]:
    """The compile-time constants of the kernel for a plan (one specialisation per model and bucket).
    The K-chunk of each matvec (BK_*) keeps its [batch, tile, K-chunk] accumulator at ACC_ELEMENTS
    (16 float32 registers per thread at 8 warps): wide chunks at batch 1 (more bytes in flight per
    program), narrower at batch 8 where a wider one would spill. `block_k` forces one chunk for all."""
    t = p.tiles
    B = _pow2(p.batch)
    Hd, F, HD = p.hidden_size, p.intermediate_size, p.num_heads * p.head_dim

    def bk(tile: int, k: int, two: bool = False) -> int:
        if block_k:
            return block_k
        if B >= 4:    # `_mv_rows`: the smallest chunk whose [TILE, chunk] tile still loads 16 bytes
            return max(16, min(MV_ROWS_ELEMENTS // _pow2(tile), 128, _pow2(k)))   # per thread (8 bf16)
        budget = ACC_ELEMENTS // (2 if two else 1)    # two matrices (gate/up, RoPE halves): two accumulators
        return max(MIN_BK, min(budget // (B * _pow2(tile)), 512, _pow2(k)))
    return dict(H=p.num_heads, KVH=p.num_kv_heads, D=p.head_dim, G_PAD=_pow2(p.num_heads // p.num_kv_heads),
                S_BLOCK=min(max(_pow2(p.splits), 2), 16), P=t.partition, BLOCK_SIZE=p.block_size,
                BLOCK_B=B, BLOCK_K=block_k or (128 if p.batch <= 2 else 64), BLOCK_T=min(_pow2(t.partition), 64),
                T_EMBED=_pow2(t.embed), T_O=_pow2(t.o), T_GU=_pow2(t.gate_up), T_DOWN=_pow2(t.down),
                T_LM=_pow2(t.lm_head), BLOCK_V=1024,
                BK_QKV=bk(p.head_dim // 2, Hd, True), BK_O=bk(t.o, HD), BK_GU=bk(t.gate_up, Hd, True),
                BK_DOWN=bk(t.down, F),
                BK_LM=bk(t.lm_head, Hd), LM_TILE=t.lm_head, TILE_E=t.embed, TILE_O=t.o, TILE_D=t.down,
                NT_PAD=max(_pow2(p.norm_tiles), 2))


MV_ROWS_ELEMENTS = 2048   # batch 4-8: weight elements per `_mv_rows` step (8 per thread at 8 warps)
ACC_ELEMENTS = 8192   # 32 float32 registers per thread at 8 warps
MIN_BK = 64   # 8 bf16 per thread along K: what lets the loads be 16 bytes wide


def profile_summary(plan: Plan, prof: torch.Tensor) -> dict:
    """Per-opcode time from the kernel's timestamps: tasks, summed busy and waiting microseconds
    over all programs, and the step's span (first wait to last signal)."""
    t = prof.cpu().double() / 1e3   # ns -> us
    ops = plan.tasks[:, 0].cpu()
    out: dict = {"span_us": float(t[:, 2].max() - t[:, 0].min()), "ops": {}}
    for op in Op:
        sel = ops == int(op)
        if sel.any():
            busy = (t[sel, 2] - t[sel, 1]).sum().item()
            wait = (t[sel, 1] - t[sel, 0]).sum().item()
            out["ops"][op.name] = {"tasks": int(sel.sum()), "busy_us": round(busy, 2), "wait_us": round(wait, 2)}
    return out


def compile_offline(plan: Plan, arch: int = 90, weight_dtype: str = "bf16", profile: bool = False,
                    num_warps: int = 8, prefetch: int = 0):
    """The kernel for `plan` on CUDA architecture `arch` (90 = Hopper), built by Triton's
    ahead-of-time compiler without a GPU (its `.asm` holds "ptx" and "cubin"). Must run without
    TRITON_INTERPRET (the interpreter replaces the JIT functions)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    const = {**kernel_constants(plan), "PROFILE": profile, "PREFETCH": prefetch}
    w = f"*{weight_dtype}"
    ptrs = {"tasks_ptr": "*i64", "sync_ptr": "*i32", "prof_ptr": "*i64" if profile else "*i32", "W_ptr": w,
            "A_ptr": "*fp32", "I_ptr": "*i64", "k_ptr": w, "v_ptr": w, "inv_freq_ptr": "*fp32"}
    # specialise the scalars as the JIT would at launch: 1 becomes a constant, multiples of 16 are
    # known divisible (what lets the compiler vectorise loads); the epoch is never specialised
    scalars = scalar_args(plan, num_slots=16 * 4096)
    names = _megakernel.arg_names
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in const:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(scalars[n], float):
            sig[n] = "fp32"
        elif scalars[n] == 1 and n != "epoch":
            sig[n] = "constexpr"
            const[n] = 1
        else:
            sig[n] = "i32"
            if scalars[n] % 16 == 0 and n != "epoch":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(_megakernel, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton_compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, spill stack and shared memory per thread/program of a compiled kernel, from the
    `cuobjdump -res-usage` that ships with Triton's CUDA backend."""
    import os
    import re
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.cubin")
        Path(f).write_bytes(cubin)
        text = subprocess.run([str(tool), "-res-usage", f], capture_output=True, text=True, check=True).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def check(s: _Static) -> None:
    """Raises if the last step's kernel timed out on a wait (a host synchronisation)."""
    err = int(s.sync[s.plan.num_events + 1].item())
    if not err:
        return
    s.reset()   # the failed step left the counters inconsistent: the next one starts from zero
    if err == -2:
        raise MegakernelError("a weight equal to -3e38 tripped the prefetch guard")
    if err < 0:
        raise MegakernelError("the ticket counter was behind its epoch (a failed step was not checked); "
                              "counters reset")
    row = s.tasks[err - 1].tolist()
    raise MegakernelError(f"task {err - 1} ({Op(row[0]).name}, layer {row[1]}, tile {row[2]}..{row[3]}) "
                          f"timed out waiting for event {row[4]} "
                          f"({s.plan.event_names[row[4]]}) to reach {row[5]}")


MAX_ROWS = 8   # the largest batch bucket: one program's [rows, tile, K-chunk] products spill past it


class MegakernelDecoder(BucketedDecoder):
    """Decode steps of a Llama-family model as one persistent-kernel launch each, with one
    validated plan per (batch, context) bucket."""

    name = "megakernel"

    def __init__(self, model: LlamaModel, kv: PagedKVCache, max_batch: int = 8, max_context: int | None = None,
                 tiles: TileConfig | None = None, plans: dict[tuple[int, int], Plan | Path] | None = None,
                 num_programs: int | None = None, programs_per_sm: int = 1, block_k: int | None = None,
                 num_warps: int = 8, prefetch: int = 0):
        why = supports(model)
        if why:
            raise ValueError(why)
        self.model, self.kv = model, kv
        self.device = kv.k.device
        self._init_buckets(model, kv, max_batch, MAX_ROWS, max_context)
        self.tiles = tiles     # None: `default_tiles` per context bucket for this GPU's programs
        dtype = kv.k.dtype if self.device.type == "cuda" else torch.float32
        self.W, self.layout = pack_weights(model, dtype=dtype, device=self.device)
        self.shares_weights = share_weights(model, self.W, self.layout)   # one copy, not two
        self.inv_freq = model.inv_freq.to(device=self.device, dtype=torch.float32).contiguous()
        self.plans: dict[tuple[int, int], Plan | Path] = dict(plans or {})
        if num_programs is None:
            num_programs = (torch.cuda.get_device_properties(self.device).multi_processor_count * programs_per_sm
                            if self.device.type == "cuda" else 2)
        self.num_programs = num_programs
        self.block_k, self.num_warps, self.prefetch = block_k, num_warps, prefetch

    @classmethod
    def unsupported(cls, model) -> str | None:
        why = supports(model)
        return None if why is None else f"the megakernel runtime cannot run this model: {why}"

    def tiles_for(self, context: int) -> TileConfig:
        """The tiles of a context bucket's plan: the ones given, else `default_tiles` for the programs."""
        return self.tiles or default_tiles(self.model.cfg, context, self.num_programs)

    def _usable(self, plan: Plan, context: int) -> bool:
        """A precompiled plan fits if it was built for this model's layout, this cache's block size
        and exactly this context bucket (more would run empty attention splits), with the tiles asked
        for if any were (the kernel takes any plan's tiles from the plan itself)."""
        return (plan.weights == self.layout and plan.block_size == self.kv.block_size
                and plan.max_context == context and plan.num_layers == self.model.cfg.num_layers
                and (self.tiles is None or plan.tiles == self.tiles))

    def plan_for(self, batch: int, context: int) -> Plan:
        """The plan of one (batch, context) bucket: the artifact's when it fits, else compiled now."""
        plan = self.plans.get((batch, context))
        if isinstance(plan, (str, Path)):   # from a compiled artifact
            plan = Plan.load(plan)
        if plan is None or not self._usable(plan, context):
            plan = compile_plan(self.model.cfg, batch, context, self.kv.block_size, self.layout,
                                self.tiles_for(context))
        validate(plan)     # also a loaded plan: a hand-edited file must not hang the GPU
        self.plans[(batch, context)] = plan
        return plan

    def _build(self, B: int, C: int) -> _Static:
        """A bucket's validated plan and its buffers."""
        plan = self.plan_for(B, C)
        A, I, _ = new_buffers(plan, self.device)
        sync = torch.zeros(plan.num_events + 2, dtype=torch.int32, device=self.device)
        return _Static(plan, A, I, sync, plan.tasks.to(self.device).contiguous())

    def fill(self, s: _Static, step: StepInput) -> None:
        fill_inputs(s.plan, s.I, step, self.kv.block_size)

    def replay(self, s: _Static, profile: torch.Tensor | None = None) -> None:
        launch(s, self.W, self.kv.k, self.kv.v, self.inv_freq, self.num_programs, block_k=self.block_k,
               num_warps=self.num_warps, profile=profile, prefetch=self.prefetch)

    def _check(self, s: _Static) -> None:
        check(s)

    @staticmethod
    def logits_of(s: _Static) -> torch.Tensor:
        return s.logits


__all__ = ["MegakernelDecoder", "MegakernelError", "launch", "check", "profile_summary", "compile_offline"]
