"""The megakernel's task table: its opcodes, its columns and the weight alignment it relies on.

The plan format (`slipstream.runtime.plan.format`) re-exports these names; they live here, in the
kernels layer, so that the Triton megakernel (`megakernel.py` beside this file) reads the same
constants the compiler writes, without importing the runtime above it. Plain Python: importing this
module does not import Triton.
"""
from __future__ import annotations

from enum import IntEnum

# -- the columns of one task row (int64) --------------------------------------------------------------
OP, LAYER, T0, T1, WAIT_EV, WAIT_COUNT, SIG_EV, W_OFF, N_OFF, AUX = range(10)
# AUX: ATTN_SPLIT: the event its group's merge (run by the last split to finish) signals; others: 0
NUM_COLS = 10
COLUMNS = ("OP", "LAYER", "T0", "T1", "WAIT_EV", "WAIT_COUNT", "SIG_EV", "W_OFF", "N_OFF", "AUX")

WEIGHT_ALIGN = 16   # elements: every weight starts on a 32-byte (bf16) / 64-byte (fp32) boundary


class Op(IntEnum):
    EMBED = 0        # x[:, T0:T1] = embed rows of the tokens
    QKV_ROPE = 1     # RMSNorm + rotation pairs [T0, T1) of one head (pair p: head p // (D/2), rows j and
                     # j + D/2 of it, j = p % (D/2)) of the fused QKV product, RoPE, q or KV-cache write
    ATTN_SPLIT = 2   # kv head T0, split T1: unnormalised softmax partials of its G query heads; the split
                     # that finishes last (its signal of SIG_EV, an acq_rel count, sees every other) then
                     # runs the group's ATTN_REDUCE and signals event AUX
    ATTN_REDUCE = 3  # kv head T0: merge the splits of its G query heads into attn. Since plan version 3 no
                     # row carries it: the last ATTN_SPLIT of the group runs it (split-K "last CTA finishes")
    O_PROJ = 4       # x[:, T0:T1] += attn @ Wo[T0:T1].T
    GATE_UP = 5      # act[:, T0:T1] = silu(h @ Wg[T0:T1].T) * (h @ Wu[T0:T1].T), h = RMSNorm(x)
    DOWN = 6         # x[:, T0:T1] += act @ Wdown[T0:T1].T
    LM_HEAD = 7      # logits[:, T0:T1] = RMSNorm(x) @ Wlm[T0:T1].T
    ARGMAX = 8       # next_tokens = argmax(logits) (lowest index on ties)


LAYER_OPS = (Op.QKV_ROPE, Op.ATTN_SPLIT, Op.ATTN_REDUCE, Op.O_PROJ, Op.GATE_UP, Op.DOWN)
