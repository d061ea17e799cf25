"""The plan format: the task table, the flat buffers' layouts and the plan file.

One decode step of a Llama-family model becomes a table of tile-level tasks (`compiler.py`); the
columns and opcodes of that table are defined in `slipstream.kernels.triton.task_table` (so that the
Triton megakernel reads the same constants without importing the runtime) and re-exported here.

Everything a task touches lives in flat buffers whose layouts are defined here, so that the torch
VM (`runtime/vm.py`, the CPU reference) and the Triton megakernel read the same table the same way:

- `W`: every weight, packed by `packing.pack_weights` in the order of `WeightLayout`;
- `A`: float32 activations (`ActLayout`): residual stream, rotated queries, attention partials, ...;
- `I`: int64 step inputs and the greedy output (`IntLayout`), filled by `inputs.fill_inputs`;
- `E`: int32 event counters, zeroed before each step;
- the paged KV cache's own `k`, `v` tensors [num_layers, slots, KVH, D].

A plan is saved as one JSON file (`Plan.save` / `Plan.load`, an exact round trip).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slipstream.config import ModelConfig
from slipstream.kernels.triton.task_table import (
    AUX,
    COLUMNS,
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
    WEIGHT_ALIGN,
    Op,
)

PLAN_VERSION = 3
"""Saved plans' format version. 3: no ATTN_REDUCE rows, the last ATTN_SPLIT of each kv group to finish
merges the group and signals event AUX (2: ATTN_REDUCE tasks; QKV_ROPE tasks cover rotation pairs
[T0, T1) of one head since 2, 1: a head)."""


class PlanError(ValueError):
    """A plan that would deadlock, race or leave outputs unwritten."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TileConfig:
    """Work per task: columns per EMBED task, rows per matrix task, tokens per attention split, and
    `qkv_parts`: tasks per head of the QKV product (a power of two dividing head_dim / 2; each task
    computes head_dim / 2 / qkv_parts rotation pairs: the same rows of both RoPE halves)."""
    embed: int = 512
    o: int = 32
    gate_up: int = 32
    down: int = 32
    lm_head: int = 64     # larger LM-head tiles spill registers in the megakernel (cuobjdump -res-usage)
    partition: int = 256
    qkv_parts: int = 1


# -- flat buffer layouts ----------------------------------------------------------------------------
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
        sizes = weight_shapes(cfg)
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


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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
    part_acc: int   # [B, H, D, S] unnormalised attention partials (splits innermost)
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
        doc = {"format": "slipstream-plan", "version": PLAN_VERSION, **self._meta(), "columns": list(COLUMNS),
               "tasks": self.tasks.tolist()}
        Path(path).write_text(json.dumps(doc, separators=(",", ":")))

    @staticmethod
    def file_version(path: str | Path) -> int | None:
        """The format version of a saved plan (None when the file is not a plan)."""
        doc = json.loads(Path(path).read_text())
        return doc.get("version") if doc.get("format") == "slipstream-plan" else None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        doc = json.loads(Path(path).read_text())
        if doc.get("format") != "slipstream-plan" or doc.get("version") != PLAN_VERSION:
            raise PlanError(f"{path}: not a version-{PLAN_VERSION} slipstream plan (version "
                            f"{doc.get('version')}: recompile it with `slipstream compile`)")
        if doc["columns"] != list(COLUMNS):
            raise PlanError(f"{path}: unexpected task columns {doc['columns']}")
        meta = {k: v for k, v in doc.items() if k not in ("format", "version", "columns", "tasks")}
        meta["tiles"] = TileConfig(**meta["tiles"])
        meta["weights"] = WeightLayout(**meta["weights"])
        tasks = torch.tensor(doc["tasks"], dtype=torch.int64).reshape(-1, NUM_COLS)
        return cls(tasks=tasks, **meta)


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def _op_name(op: int) -> str:
    return Op(op).name if op in Op._value2member_map_ else f"op{op}"


def task_text(i: int, r: list[int]) -> str:
    """`task i (OPCODE layer l [t0, t1))` for messages, from the task's row."""
    where = f" layer {r[LAYER]}" if r[OP] in [int(o) for o in LAYER_OPS] else ""
    return f"task {i} ({_op_name(r[OP])}{where} [{r[T0]}, {r[T1]}))"


def describe_task(plan: Plan, i: int) -> str:
    return task_text(i, plan.tasks[i].tolist())


__all__ = ["PLAN_VERSION", "AUX", "COLUMNS", "LAYER", "LAYER_OPS", "LAYER_WEIGHTS", "N_OFF", "NUM_COLS", "OP",
           "SIG_EV", "T0", "T1", "W_OFF", "WAIT_COUNT", "WAIT_EV", "WEIGHT_ALIGN", "ActLayout", "IntLayout", "Op",
           "Plan", "PlanError", "TileConfig", "WeightLayout", "cdiv", "describe_task", "task_text", "weight_shapes"]
