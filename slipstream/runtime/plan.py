"""The decode step lowered into a *plan*: a table of tile-level tasks for the persistent megakernel.

DESIGN.md, "The engine layer, in steps", item 3. One decode step of a Llama-family model (one new
token per sequence, batch B) becomes a list of tasks in topological order. A persistent kernel (one
program per SM) takes tasks in that order from an atomic counter, waits until the task's event
counter reaches its expected count, runs the task and increments one event counter. Because every
task only waits on events signalled by tasks *earlier* in the order, the kernel cannot deadlock
whatever the number of programs, and it runs under `TRITON_INTERPRET=1` too.

Everything a task touches lives in flat buffers whose layouts are defined here, so that the torch
VM (`vm.py`, the CPU reference) and the Triton megakernel read the same table the same way:

- `W`: every weight, packed by `pack_weights` in the order of `WeightLayout`;
- `A`: float32 activations (`ActLayout`): residual stream, rotated queries, attention partials, ...;
- `I`: int64 step inputs and the greedy output (`IntLayout`), filled by `fill_inputs`;
- `E`: int32 event counters, zeroed before each step;
- the paged KV cache's own `k`, `v` tensors [num_layers, slots, KVH, D].

`validate` checks a plan statically (structure, counts, order, and that no task can touch a buffer
region before the task that produces it signals), so a hand-edited or loaded plan is checked too.
"""
from __future__ import annotations

import dataclasses
import json
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import torch

from slipstream.config import ModelConfig
from slipstream.kv.blocks import block_ids
from slipstream.models.llama import LlamaModel
from slipstream.step import StepInput
from slipstream.weights.quant import Linear

# -- the task table ---------------------------------------------------------------------------------
OP, LAYER, T0, T1, WAIT_EV, WAIT_COUNT, SIG_EV, W_OFF, N_OFF, AUX = range(10)
NUM_COLS = 10
COLUMNS = ("OP", "LAYER", "T0", "T1", "WAIT_EV", "WAIT_COUNT", "SIG_EV", "W_OFF", "N_OFF", "AUX")


class Op(IntEnum):
    EMBED = 0        # x[:, T0:T1] = embed rows of the tokens
    QKV_ROPE = 1     # RMSNorm + one head (T0) of the fused QKV product, RoPE, q or KV-cache write
    ATTN_SPLIT = 2   # kv head T0, split T1: unnormalised softmax partials of its G query heads
    ATTN_REDUCE = 3  # kv head T0: merge the splits of its G query heads into attn
    O_PROJ = 4       # x[:, T0:T1] += attn @ Wo[T0:T1].T
    GATE_UP = 5      # act[:, T0:T1] = silu(h @ Wg[T0:T1].T) * (h @ Wu[T0:T1].T), h = RMSNorm(x)
    DOWN = 6         # x[:, T0:T1] += act @ Wdown[T0:T1].T
    LM_HEAD = 7      # logits[:, T0:T1] = RMSNorm(x) @ Wlm[T0:T1].T
    ARGMAX = 8       # next_tokens = argmax(logits) (lowest index on ties)


LAYER_OPS = (Op.QKV_ROPE, Op.ATTN_SPLIT, Op.ATTN_REDUCE, Op.O_PROJ, Op.GATE_UP, Op.DOWN)


class PlanError(ValueError):
    """A plan that would deadlock, race or leave outputs unwritten."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TileConfig:
    """Work per task: columns per EMBED task, rows per matrix task, tokens per attention split."""
    embed: int = 512
    o: int = 32
    gate_up: int = 32
    down: int = 32
    lm_head: int = 64     # larger LM-head tiles spill registers in the megakernel (cuobjdump -res-usage)
    partition: int = 256


def default_tiles(cfg: ModelConfig, max_context: int, num_programs: int, fill: bool = True) -> TileConfig:
    """The megakernel plan's tiles for a context bucket on `num_programs` persistent programs, as the
    GPU latency model (`benchmarks/gpu_model.py`) chose them. With `fill`, the phases whose base tiles
    leave programs idle get about as many tasks as programs (at least 95%: dense-1B and -8B get 128
    for 132 SMs, where the next halving would double the tasks and their fixed cost): O and DOWN rows
    per task (a power of two, at least 16) and attention partitions (a power of two, at least 16
    tokens: kv heads x splits of the bucket's context). The QKV phase (one task per head) is not cut."""
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
    return dataclasses.replace(base, o=rows, down=rows, partition=part)


# -- flat buffer layouts ----------------------------------------------------------------------------
WEIGHT_ALIGN = 16   # elements: every weight starts on a 32-byte (bf16) / 64-byte (fp32) boundary
LAYER_WEIGHTS = ("attn_norm", "qkv", "o", "ffn_norm", "gate_up", "down")


@dataclass
class WeightLayout:
    """Element offsets of every weight in the flat weight buffer `W` (matrices row-major)."""
    layers: list[dict[str, int]]
    norm: int
    lm_head: int
    embed: int       # == lm_head when the embeddings are tied (stored once)
    total: int

    @classmethod
    def for_config(cls, cfg: ModelConfig, tied: bool) -> "WeightLayout":
        sizes = _weight_shapes(cfg)
        off = 0

        def take(shape: tuple[int, ...]) -> int:
            nonlocal off
            start = -(-off // WEIGHT_ALIGN) * WEIGHT_ALIGN   # aligned: the kernel loads 16 bytes at a time
            off = start + _numel(shape)
            return start
        layers = [{name: take(sizes[name]) for name in LAYER_WEIGHTS} for _ in range(cfg.num_layers)]
        norm = take(sizes["norm"])
        lm_head = take(sizes["lm_head"])
        embed = lm_head if tied else take(sizes["embed"])
        return cls(layers, norm, lm_head, embed, off)

    @property
    def tied(self) -> bool:
        return self.embed == self.lm_head


def _weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, KVH, D, Hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    F, V = cfg.intermediate_size, cfg.vocab_size
    return {"attn_norm": (Hd,), "qkv": ((H + 2 * KVH) * D, Hd), "o": (Hd, H * D), "ffn_norm": (Hd,),
            "gate_up": (2 * F, Hd), "down": (Hd, F), "norm": (Hd,), "lm_head": (V, Hd), "embed": (V, Hd)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _regions(names_and_sizes: list[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """Contiguous regions in the given order: their offsets and the total size."""
    offsets, off = {}, 0
    for name, size in names_and_sizes:
        offsets[name] = off
        off += size
    return offsets, off


@dataclass
class ActLayout:
    """Element offsets in the float32 activation buffer `A` (regions contiguous, row-major)."""
    x: int          # [B, Hd] residual stream
    q: int          # [B, H, D] rotated queries
    part_acc: int   # [B, H, S, D] unnormalised attention partials
    part_m: int     # [B, H, S] running max of each split
    part_l: int     # [B, H, S] softmax denominator of each split
    attn: int       # [B, H*D] attention output
    act: int        # [B, F] SwiGLU output
    logits: int     # [B, V]
    lm_max: int     # [B, LM tiles] each LM-head tile's largest logit per row (ARGMAX reduces these)
    lm_idx: int     # [B, LM tiles] its first index (exact in float32: vocabularies < 2^24)
    sumsq: int      # [2L + 1, B, norm tiles] per residual-stream version, per row, per tile: the tile's
                    # sum of x^2, written by the task that finished it (EMBED, O_PROJ, DOWN); the next
                    # norm's consumers sum these partials instead of re-reading all of x
    total: int

    @classmethod
    def build(cls, batch: int, hidden: int, heads: int, head_dim: int, splits: int, ffn: int,
              vocab: int, lm_tiles: int = 1, norm_slots: int = 1, norm_tiles: int = 1) -> "ActLayout":
        B, H, D, S = batch, heads, head_dim, splits
        offsets, total = _regions([("x", B * hidden), ("q", B * H * D), ("part_acc", B * H * S * D),
                                   ("part_m", B * H * S), ("part_l", B * H * S), ("attn", B * H * D),
                                   ("act", B * ffn), ("logits", B * vocab), ("lm_max", B * lm_tiles),
                                   ("lm_idx", B * lm_tiles), ("sumsq", norm_slots * B * norm_tiles)])
        return cls(**offsets, total=total)


@dataclass
class IntLayout:
    """Element offsets in the int64 buffer `I` (the step's inputs and the greedy output)."""
    tokens: int        # [B]
    positions: int     # [B]
    write_slots: int   # [B], -1: a padded row (no KV write)
    context_lens: int  # [B], >= 1, includes the token being decoded
    block_tables: int  # [B, max_blocks]
    next_tokens: int   # [B] written by ARGMAX
    total: int

    @classmethod
    def build(cls, batch: int, max_blocks: int) -> "IntLayout":
        B = batch
        offsets, total = _regions([("tokens", B), ("positions", B), ("write_slots", B), ("context_lens", B),
                                   ("block_tables", B * max_blocks), ("next_tokens", B)])
        return cls(**offsets, total=total)


# -- the plan -------------------------------------------------------------------------------------
@dataclass(eq=False)
class Plan:
    tasks: torch.Tensor            # int64 [T, NUM_COLS], in topological order
    event_names: list[str]
    event_counts: list[int]        # signals each event receives per step
    batch: int
    max_context: int
    block_size: int
    max_blocks: int                # cdiv(max_context, block_size): the block table's width
    splits: int                    # S = cdiv(max_context, tiles.partition)
    tiles: TileConfig
    num_layers: int                # L
    hidden_size: int               # Hd
    num_heads: int                 # H
    num_kv_heads: int              # KVH
    head_dim: int                  # D
    intermediate_size: int         # F
    vocab_size: int                # V
    rms_norm_eps: float
    weights: WeightLayout
    acts: ActLayout = field(init=False)
    ints: IntLayout = field(init=False)

    def __post_init__(self) -> None:
        self.acts = ActLayout.build(self.batch, self.hidden_size, self.num_heads, self.head_dim, self.splits,
                                    self.intermediate_size, self.vocab_size, self.lm_tiles,
                                    2 * self.num_layers + 1, self.norm_tiles)
        self.ints = IntLayout.build(self.batch, self.max_blocks)

    @property
    def group(self) -> int:
        """G: query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def lm_tiles(self) -> int:
        """LM-head tasks: each leaves its tile's (max, first index) per row for ARGMAX."""
        return cdiv(self.vocab_size, self.tiles.lm_head)

    def norm_producers(self, slot: int) -> int:
        """Tiles that write residual-stream version `slot`'s sums of squares: 0 after EMBED, 2l + 1
        after layer l's O_PROJ, 2l + 2 after its DOWN (the last one feeds the final norm)."""
        t = self.tiles
        tile = t.embed if slot == 0 else (t.o if slot % 2 else t.down)
        return cdiv(self.hidden_size, tile)

    @property
    def norm_tiles(self) -> int:
        """The widest producer count: the row stride of the sums-of-squares region."""
        return max(self.norm_producers(s) for s in range(3))

    @property
    def num_tasks(self) -> int:
        return int(self.tasks.shape[0])

    @property
    def num_events(self) -> int:
        return len(self.event_names)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return torch.equal(self.tasks, other.tasks) and self._meta() == other._meta()

    # -- persistence ------------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        skip = {"tasks", "acts", "ints"}   # acts and ints follow from the dims
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in skip}

    def save(self, path: str | Path) -> None:
        """One JSON file: the metadata and the task table as a nested list (exact round trip)."""
        doc = {"format": "slipstream-plan", "version": 1, **self._meta(), "columns": list(COLUMNS),
               "tasks": self.tasks.tolist()}
        Path(path).write_text(json.dumps(doc, separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        doc = json.loads(Path(path).read_text())
        if doc.get("format") != "slipstream-plan" or doc.get("version") != 1:
            raise PlanError(f"{path}: not a version-1 slipstream plan")
        if doc["columns"] != list(COLUMNS):
            raise PlanError(f"{path}: unexpected task columns {doc['columns']}")
        meta = {k: v for k, v in doc.items() if k not in ("format", "version", "columns", "tasks")}
        meta["tiles"] = TileConfig(**meta["tiles"])
        meta["weights"] = WeightLayout(**meta["weights"])
        tasks = torch.tensor(doc["tasks"], dtype=torch.int64).reshape(-1, NUM_COLS)
        return cls(tasks=tasks, **meta)

    def describe(self) -> str:
        """A few lines for logs and the CLI: tasks per opcode and the event families."""
        ops = Counter(int(o) for o in self.tasks[:, OP].tolist())
        lines = [f"plan: {self.num_tasks} tasks, {self.num_events} events; batch {self.batch}, "
                 f"max_context {self.max_context} ({self.splits} splits of {self.tiles.partition}), "
                 f"block_size {self.block_size}",
                 "  tasks: " + ", ".join(f"{_op_name(o)} {n}" for o, n in sorted(ops.items()))]
        families: dict[str, list[int]] = {}
        for name, count in zip(self.event_names, self.event_counts):
            families.setdefault(name.split("[")[0], []).append(count)
        lines.append("  events: " + ", ".join(
            f"{fam} x{len(c)} (count {_span_text(c)})" for fam, c in families.items()))
        return "\n".join(lines)


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def _span_text(counts: list[int]) -> str:
    lo, hi = min(counts), max(counts)
    return str(lo) if lo == hi else f"{lo}..{hi}"


# -- the compiler ---------------------------------------------------------------------------------
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
             w_off: int = -1, n_off: int = -1) -> None:
        wait_ev, wait_count = (-1, 0) if wait is None else (wait, self.counts[wait])
        self.rows.append([int(op), layer, t0, t1, wait_ev, wait_count, sig, w_off, n_off, 0])


def compile_plan(cfg: ModelConfig, batch: int, max_context: int, block_size: int, layout: WeightLayout,
                 tiles: TileConfig = TileConfig()) -> Plan:
    """Lowers one decode step of `cfg` at this batch size and context bound into a plan."""
    _check_compile_args(cfg, batch, max_context, block_size, layout, tiles)
    L, Hd, H, KVH = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
    F, V, G = cfg.intermediate_size, cfg.vocab_size, cfg.num_heads // cfg.num_kv_heads
    S = cdiv(max_context, tiles.partition)
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
        qkv_done = [b.event(f"qkv_done[{li}][{g}]", G + 2) for g in range(KVH)]
        split_done = [b.event(f"split_done[{li}][{g}]", S) for g in range(KVH)]
        attn_done = b.event(f"attn_done[{li}]", KVH)
        o_done = b.event(f"o_done[{li}]", len(o_tiles))
        gu_done = b.event(f"gu_done[{li}]", len(gu_tiles))
        down_done = b.event(f"down_done[{li}]", len(down_tiles))
        for g in range(KVH):
            for head in [*range(g * G, (g + 1) * G), H + g, H + KVH + g]:
                b.task(Op.QKV_ROPE, li, head, head + 1, ready, qkv_done[g], w["qkv"], w["attn_norm"])
        for g in range(KVH):
            for s in range(S):
                b.task(Op.ATTN_SPLIT, li, g, s, qkv_done[g], split_done[g])
        for g in range(KVH):
            b.task(Op.ATTN_REDUCE, li, g, g + 1, split_done[g], attn_done)
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
    if layout not in (WeightLayout.for_config(cfg, True), WeightLayout.for_config(cfg, False)):
        raise ValueError("the weight layout was not made for this model config")


# -- weights --------------------------------------------------------------------------------------
def supports(model: Any) -> str | None:
    """None when the megakernel can run `model`, else why not (the caller falls back to another runtime)."""
    if not isinstance(model, LlamaModel):
        return f"needs a Llama-family model, got {type(model).__name__}"
    for i, layer in enumerate(model.layers):
        if layer.qkv.bias is not None:
            return f"layer {i} has q/k/v biases"
        if layer.q_norm is not None or layer.k_norm is not None:
            return f"layer {i} has q/k norms"
    D = model.cfg.head_dim
    if D & (D - 1):
        return f"head_dim {D} is not a power of two"
    if D != 2 * model.inv_freq.numel():
        return "partial rotary embeddings (RoPE over part of the head)"
    return None


def pack_weights(model: LlamaModel, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, WeightLayout]:
    """Every weight of `model`, in `WeightLayout` order, in one flat tensor (packed GGUF weights dequantized)."""
    reason = supports(model)
    if reason is not None:
        raise ValueError(f"the megakernel cannot run this model: {reason}")
    cfg = model.cfg
    layout = WeightLayout.for_config(cfg, tied=model.embed is model.lm_head)
    shapes = _weight_shapes(cfg)
    W = torch.empty(layout.total, dtype=dtype, device=device)

    def put(offset: int, name: str, w: Linear | torch.Tensor) -> None:
        t = w.dequantize() if isinstance(w, Linear) else w
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name}: expected shape {shapes[name]}, got {tuple(t.shape)}")
        W[offset:offset + t.numel()].copy_(t.reshape(-1))
    for offsets, layer in zip(layout.layers, model.layers):
        for name in LAYER_WEIGHTS:
            put(offsets[name], name, getattr(layer, name))
    put(layout.norm, "norm", model.norm)
    put(layout.lm_head, "lm_head", model.lm_head)
    if not layout.tied:
        put(layout.embed, "embed", model.embed)
    return W, layout


def share_weights(model: LlamaModel, W: torch.Tensor, layout: WeightLayout) -> bool:
    """Points the model's dense matrices at their copies in `W`, so that the eager step (prefill)
    and the megakernel read one copy of the weights instead of two (16 GB saved at dense-8B).
    Packed or differently typed weights are left alone (False)."""
    mats = [(getattr(L, name), offs[name]) for L, offs in zip(model.layers, layout.layers)
            for name in ("qkv", "o", "gate_up", "down")]
    mats.append((model.lm_head, layout.lm_head))
    if not layout.tied:
        mats.append((model.embed, layout.embed))
    if any(m.packed or m.data.dtype != W.dtype or m.data.device != W.device for m, _ in mats):
        return False
    for m, off in mats:
        m.data = W[off:off + m.n * m.k].view(m.n, m.k)
    return True


# -- step inputs ------------------------------------------------------------------------------------
def new_buffers(plan: Plan, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeroed (A float32, I int64, E int32) buffers for `plan`."""
    return (torch.zeros(plan.acts.total, dtype=torch.float32, device=device),
            torch.zeros(plan.ints.total, dtype=torch.int64, device=device),
            torch.zeros(plan.num_events, dtype=torch.int32, device=device))


def fill_inputs(plan: Plan, I: torch.Tensor, step: StepInput, block_size: int) -> None:
    """Writes a decode step's tokens, positions, write slots, context lengths and block tables into `I`
    (one host-to-device copy). Rows past the step's are padding: token 0, position 0, write slot -1
    (no KV write), context 1, block table of zeros."""
    if block_size != plan.block_size:
        raise ValueError(f"the plan was compiled for block size {plan.block_size}, the cache has {block_size}")
    B, lay = int(step.token_ids.shape[0]), plan.ints
    if B > plan.batch:
        raise ValueError(f"{B} sequences in a plan for batch {plan.batch}")
    if len(step.seqs) != B or any(s.length != 1 for s in step.seqs):
        raise ValueError("a plan decodes exactly one token per sequence")
    host = torch.zeros(lay.total, dtype=torch.int64)
    host[lay.tokens:lay.tokens + B] = step.token_ids.cpu()
    host[lay.positions:lay.positions + B] = step.positions.cpu()
    slots = host[lay.write_slots:lay.write_slots + plan.batch]
    slots.fill_(-1)
    slots[:B] = step.write_slots.cpu()
    ctx = host[lay.context_lens:lay.context_lens + plan.batch]
    ctx.fill_(1)
    tables = host[lay.block_tables:lay.block_tables + plan.batch * plan.max_blocks].view(plan.batch, plan.max_blocks)
    for s in step.seqs:
        if s.context > plan.max_context:
            raise ValueError(f"context {s.context} exceeds the plan's max_context {plan.max_context}")
        ctx[s.start] = s.context
        blocks = block_ids(s.read, block_size)
        tables[s.start, :blocks.numel()] = blocks
    I.copy_(host)


# -- the static validator ---------------------------------------------------------------------------
def describe_task(plan: Plan, i: int) -> str:
    r = plan.tasks[i].tolist()
    return _task_text(i, r)


def _op_name(op: int) -> str:
    return Op(op).name if op in Op._value2member_map_ else f"op{op}"


def _task_text(i: int, r: list[int]) -> str:
    where = f" layer {r[LAYER]}" if r[OP] in [int(o) for o in LAYER_OPS] else ""
    return f"task {i} ({_op_name(r[OP])}{where} [{r[T0]}, {r[T1]}))"


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
    _check_coverage(plan, rows)
    _check_events(plan, rows)
    _check_data_flow(plan, rows)


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
    return {Op.EMBED: plan.hidden_size, Op.QKV_ROPE: H + 2 * KVH, Op.ATTN_SPLIT: KVH, Op.ATTN_REDUCE: KVH,
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
    if op in (Op.QKV_ROPE, Op.ATTN_REDUCE) and r[T1] != r[T0] + 1:
        raise fail("a head task covers exactly one head")
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
    if r[AUX] != 0:
        raise fail("AUX is reserved and must be 0")


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
    x = ("x",)
    def ss(slot: int) -> tuple:
        return ("sumsq", slot)
    if op == Op.EMBED:
        return [], [(x, t0, t1), (ss(0), t0 // plan.tiles.embed, t0 // plan.tiles.embed + 1)]
    if op == Op.QKV_ROPE:
        out: tuple[tuple, int, int]
        if t0 < H:
            out = (("q",), t0, t0 + 1)
        elif t0 < H + KVH:
            out = (("k", li), t0 - H, t0 - H + 1)
        else:
            out = (("v", li), t0 - H - KVH, t0 - H - KVH + 1)
        return [(x, 0, Hd), (ss(2 * li), 0, plan.norm_producers(2 * li))], [out]
    if op == Op.ATTN_SPLIT:
        g, s = t0, t1
        return ([(("q",), g * G, (g + 1) * G), (("k", li), g, g + 1), (("v", li), g, g + 1)],
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
    return {"x": plan.hidden_size, "q": plan.num_heads, "k": plan.num_kv_heads, "v": plan.num_kv_heads,
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
