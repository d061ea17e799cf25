"""A plan's per-step buffers and the decode step's inputs written into them."""
from __future__ import annotations

import torch

from slipstream.kv.blocks import block_ids
from slipstream.runtime.plan.format import Plan
from slipstream.step import StepInput


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

