"""The decode step lowered into a *plan*: a table of tile-level tasks for the persistent megakernel.

DESIGN.md, "The engine layer, in steps", item 3. One module per job:

- `format`: the task table (opcodes and columns, shared with the Triton kernel through
  `kernels/triton/task_table.py`), the flat buffers' layouts, `Plan` and its file (save/load);
- `compiler`: `compile_plan` lowers one decode step into the table; `default_tiles` sizes its tasks;
- `validator`: `validate` checks a plan statically (structure, counts, order, data flow), so a
  hand-edited or loaded plan is checked too;
- `packing`: which models a plan runs (`supports`), their weights in one flat buffer (`pack_weights`),
  and `share_weights`, which points the model at that buffer (it mutates the model, deliberately);
- `inputs`: a plan's buffers (`new_buffers`) and a decode step written into them (`fill_inputs`).

The names below are importable from `slipstream.runtime.plan` itself.
"""
from __future__ import annotations

from slipstream.runtime.plan.compiler import compile_plan, default_tiles, tile_ranges
from slipstream.runtime.plan.format import (
    AUX,
    COLUMNS,
    LAYER,
    LAYER_OPS,
    LAYER_WEIGHTS,
    N_OFF,
    NUM_COLS,
    OP,
    PLAN_VERSION,
    SIG_EV,
    T0,
    T1,
    W_OFF,
    WAIT_COUNT,
    WAIT_EV,
    WEIGHT_ALIGN,
    ActLayout,
    IntLayout,
    Op,
    Plan,
    PlanError,
    TileConfig,
    WeightLayout,
    cdiv,
    describe_task,
)
from slipstream.runtime.plan.inputs import fill_inputs, new_buffers
from slipstream.runtime.plan.packing import pack_weights, share_weights, supports
from slipstream.runtime.plan.validator import validate

__all__ = ["AUX", "COLUMNS", "LAYER", "LAYER_OPS", "LAYER_WEIGHTS", "N_OFF", "NUM_COLS", "OP", "PLAN_VERSION",
           "SIG_EV", "T0", "T1", "W_OFF", "WAIT_COUNT", "WAIT_EV", "WEIGHT_ALIGN", "ActLayout", "IntLayout", "Op",
           "Plan", "PlanError", "TileConfig", "WeightLayout", "cdiv", "compile_plan", "default_tiles", "describe_task",
           "fill_inputs", "new_buffers", "pack_weights", "share_weights", "supports", "tile_ranges", "validate"]
