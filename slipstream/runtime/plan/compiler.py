"""The plan compiler: one decode step of a Llama-family model lowered into a task table.

The tasks come in topological order: a persistent kernel (one program per SM) takes them in that
order from an atomic counter, waits until the task's event counter reaches its expected count,
runs the task and increments one event counter. Because every task only waits on events signalled
by tasks *earlier* in the order, the kernel cannot deadlock whatever the number of programs, and it
runs under `TRITON_INTERPRET=1` too. `default_tiles` chooses the work per task for a GPU.
"""
from __future__ import annotations

import dataclasses

import torch

from slipstream.config import ModelConfig
from slipstream.runtime.plan.format import Op, Plan, TileConfig, WeightLayout, cdiv


def default_tiles(cfg: ModelConfig, max_context: int, num_programs: int, fill: bool = True) -> TileConfig:
    """The megakernel plan's tiles for a context bucket on `num_programs` persistent programs, as the
    GPU latency model (`benchmarks/gpu_model.py`) chose them. With `fill`, the phases whose base tiles
    leave programs idle get about as many tasks as programs (at least 95%: dense-1B and -8B get 128
    for 132 SMs, where the next halving would double the tasks and their fixed cost): O and DOWN rows
    per task (a power of two, at least 16) and attention partitions (a power of two, at least 16
    tokens: kv heads x splits of the bucket's context). The QKV phase (H + 2 KVH heads) is cut into
    the most parts per head (a power of two, at least 4 rotation pairs each) that still fit in one
    round of the programs: more would add a second round of tasks, each still latency-bound."""
    base = TileConfig()
    if not fill:
        return base
    enough = 0.95 * num_programs
    rows = base.o
    while rows > 16 and cdiv(cfg.hidden_size, rows) < enough:
        rows //= 2
    part = 16
    # (bounded by the context: with few programs, e.g. 1 under the interpreter, the count never drops below)
    while part < max_context and cfg.num_kv_heads * cdiv(max_context, part * 2) >= enough:
        part *= 2
    # gate/up and LM-head tiles grow (up to 64 / 128 rows: the widest whose K-chunk keeps the register
    # budget at 16-byte loads, `megakernel.MIN_BK`) while the phase keeps about one task per program:
    # fewer tasks, each paying its ticket, poll and signal once
    gate_up = base.gate_up
    while gate_up < 64 and cdiv(cfg.intermediate_size, gate_up * 2) >= enough:
        gate_up *= 2
    # (at hidden 4096 a 128-row LM tile beside 64-row gate/up tiles spills 80 bytes with Triton 3.6,
    # cuobjdump -res-usage; gate/up gains more there: dense-8B keeps 64-row LM tiles)
    lm_head = 128 if cfg.hidden_size <= 2048 else base.lm_head
    heads, half = cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim // 2
    qkv_parts = 1
    while half % (qkv_parts * 2) == 0 and half // (qkv_parts * 2) >= 4 and heads * qkv_parts * 2 <= num_programs:
        qkv_parts *= 2
    return dataclasses.replace(base, o=rows, down=rows, gate_up=gate_up, lm_head=lm_head, partition=part,
                               qkv_parts=qkv_parts)


def tile_ranges(n: int, size: int) -> list[tuple[int, int]]:
    """[0, n) in tiles of `size` (the last one may be short)."""
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


class _Builder:
    """Collects events (name, expected count) and task rows in order."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.counts: list[int] = []
        self.rows: list[list[int]] = []

    def event(self, name: str, count: int) -> int:
        self.names.append(name)
        self.counts.append(count)
        return len(self.names) - 1

    def task(self, op: Op, layer: int, t0: int, t1: int, wait: int | None, sig: int,
             w_off: int = -1, n_off: int = -1, aux: int = 0) -> None:
        wait_ev, wait_count = (-1, 0) if wait is None else (wait, self.counts[wait])
        self.rows.append([int(op), layer, t0, t1, wait_ev, wait_count, sig, w_off, n_off, aux])


def compile_plan(cfg: ModelConfig, batch: int, max_context: int, block_size: int, layout: WeightLayout,
                 tiles: TileConfig | None = None) -> Plan:
    """Lowers one decode step of `cfg` at this batch size and context bound into a plan (`tiles`:
    the work per task, by default the base `TileConfig()`)."""
    tiles = tiles or TileConfig()
    _check_compile_args(cfg, batch, max_context, block_size, layout, tiles)
    L, Hd, H, KVH = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
    F, V, G = cfg.intermediate_size, cfg.vocab_size, cfg.num_heads // cfg.num_kv_heads
    S = cdiv(max_context, tiles.partition)
    half = cfg.head_dim // 2
    pairs = half // tiles.qkv_parts
    embed_tiles, o_tiles = tile_ranges(Hd, tiles.embed), tile_ranges(Hd, tiles.o)
    gu_tiles, down_tiles = tile_ranges(F, tiles.gate_up), tile_ranges(Hd, tiles.down)
    lm_tiles = tile_ranges(V, tiles.lm_head)

    b = _Builder()
    embed_done = b.event("embed_done", len(embed_tiles))
    for lo, hi in embed_tiles:
        b.task(Op.EMBED, 0, lo, hi, None, embed_done, layout.embed)
    ready = embed_done            # what the next layer's QKV waits on
    for li in range(L):
        w = layout.layers[li]
        qkv_done = [b.event(f"qkv_done[{li}][{g}]", (G + 2) * tiles.qkv_parts) for g in range(KVH)]
        split_done = [b.event(f"split_done[{li}][{g}]", S) for g in range(KVH)]
        attn_done = b.event(f"attn_done[{li}]", KVH)
        o_done = b.event(f"o_done[{li}]", len(o_tiles))
        gu_done = b.event(f"gu_done[{li}]", len(gu_tiles))
        down_done = b.event(f"down_done[{li}]", len(down_tiles))
        for g in range(KVH):
            for head in [*range(g * G, (g + 1) * G), H + g, H + KVH + g]:
                for j0 in range(0, half, pairs):    # rotation pairs [j0, j0 + pairs) of the head
                    b.task(Op.QKV_ROPE, li, head * half + j0, head * half + j0 + pairs, ready, qkv_done[g],
                           w["qkv"], w["attn_norm"])
        # the group's ATTN_REDUCE is run by its last split to finish, which then signals attn_done (AUX)
        for g in range(KVH):
            for s in range(S):
                b.task(Op.ATTN_SPLIT, li, g, s, qkv_done[g], split_done[g], aux=attn_done)
        for lo, hi in o_tiles:
            b.task(Op.O_PROJ, li, lo, hi, attn_done, o_done, w["o"])
        for lo, hi in gu_tiles:
            b.task(Op.GATE_UP, li, lo, hi, o_done, gu_done, w["gate_up"], w["ffn_norm"])
        for lo, hi in down_tiles:
            b.task(Op.DOWN, li, lo, hi, gu_done, down_done, w["down"])
        ready = down_done
    logits_done = b.event("logits_done", len(lm_tiles))
    step_done = b.event("step_done", 1)
    for lo, hi in lm_tiles:
        b.task(Op.LM_HEAD, 0, lo, hi, ready, logits_done, layout.lm_head, layout.norm)
    b.task(Op.ARGMAX, 0, 0, V, logits_done, step_done)

    return Plan(tasks=torch.tensor(b.rows, dtype=torch.int64), event_names=b.names, event_counts=b.counts,
                batch=batch, max_context=max_context, block_size=block_size,
                max_blocks=cdiv(max_context, block_size), splits=S, tiles=tiles, num_layers=L,
                hidden_size=Hd, num_heads=H, num_kv_heads=KVH, head_dim=cfg.head_dim, intermediate_size=F,
                vocab_size=V, rms_norm_eps=float(cfg.rms_norm_eps), weights=layout)


def _check_compile_args(cfg: ModelConfig, batch: int, max_context: int, block_size: int,
                        layout: WeightLayout, tiles: TileConfig) -> None:
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"{cfg.num_heads} heads do not split into {cfg.num_kv_heads} kv groups")
    if min(batch, max_context, block_size) < 1:
        raise ValueError("batch, max_context and block_size must be positive")
    if min(dataclasses.astuple(tiles)) < 1:
        raise ValueError(f"tile sizes must be positive: {tiles}")
    q = tiles.qkv_parts
    if q & (q - 1) or (cfg.head_dim // 2) % q:
        raise ValueError(f"qkv_parts {q} is not a power of two dividing head_dim / 2 = {cfg.head_dim // 2}")
    if layout not in (WeightLayout.for_config(cfg, True), WeightLayout.for_config(cfg, False)):
        raise ValueError("the weight layout was not made for this model config")

