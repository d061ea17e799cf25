"""A torch executor of plans (`runtime/plan/`): the CPU reference for the persistent Triton megakernel.

It runs the task table in order, one task at a time, at exactly the kernel's tile granularity,
reading and writing the same flat buffers through views, so a wrong offset, tile bound or event in
a plan shows up here as a wrong logit or a failed wait. All arithmetic is float32.
"""
from __future__ import annotations

import math
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from slipstream.kv.blocks import PagedKVCache
from slipstream.models.llama import LlamaModel
from slipstream.runtime.plan import (
    AUX,
    LAYER,
    N_OFF,
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
    TileConfig,
    compile_plan,
    describe_task,
    fill_inputs,
    new_buffers,
    pack_weights,
    supports,
)
from slipstream.step import StepInput


class _Views:
    """Typed views of the flat buffers for one plan."""

    def __init__(self, plan: Plan, W: torch.Tensor, A: torch.Tensor, I: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, inv_freq: torch.Tensor):
        B, H, S, D = plan.batch, plan.num_heads, plan.splits, plan.head_dim
        a, n = plan.acts, plan.ints
        self.plan, self.W, self.k, self.v = plan, W, k, v
        self.inv_freq = inv_freq.to(torch.float32)
        self.x = A[a.x:a.x + B * plan.hidden_size].view(B, plan.hidden_size)
        self.q = A[a.q:a.q + B * H * D].view(B, H, D)
        # stored [B, H, D, S] (splits innermost: the megakernel's reduce sums them within a warp),
        # indexed [b, head, split, d]
        self.part_acc = A[a.part_acc:a.part_acc + B * H * S * D].view(B, H, D, S).transpose(2, 3)
        self.part_m = A[a.part_m:a.part_m + B * H * S].view(B, H, S)
        self.part_l = A[a.part_l:a.part_l + B * H * S].view(B, H, S)
        self.attn = A[a.attn:a.attn + B * H * D].view(B, H * D)
        self.act = A[a.act:a.act + B * plan.intermediate_size].view(B, plan.intermediate_size)
        self.logits = A[a.logits:a.logits + B * plan.vocab_size].view(B, plan.vocab_size)
        self.lm_max = A[a.lm_max:a.lm_max + B * plan.lm_tiles].view(B, plan.lm_tiles)
        self.lm_idx = A[a.lm_idx:a.lm_idx + B * plan.lm_tiles].view(B, plan.lm_tiles)
        slots, nt = 2 * plan.num_layers + 1, plan.norm_tiles
        self.sumsq = A[a.sumsq:a.sumsq + slots * B * nt].view(slots, B, nt)
        self.tokens = I[n.tokens:n.tokens + B]
        self.positions = I[n.positions:n.positions + B]
        self.write_slots = I[n.write_slots:n.write_slots + B]
        self.context_lens = I[n.context_lens:n.context_lens + B]
        self.block_tables = I[n.block_tables:n.block_tables + B * plan.max_blocks].view(B, plan.max_blocks)
        self.next_tokens = I[n.next_tokens:n.next_tokens + B]

    def matrix(self, offset: int, rows: int, cols: int) -> torch.Tensor:
        """A whole [rows, cols] weight matrix of W (the task slices its tile)."""
        return self.W[offset:offset + rows * cols].view(rows, cols)

    def normed_x(self, norm_off: int, slot: int) -> torch.Tensor:
        """RMSNorm of the residual stream times the norm weight at `norm_off`, its statistics summed
        from the per-tile sums of squares that residual-stream version `slot`'s producers left."""
        p = self.plan
        w = self.W[norm_off:norm_off + p.hidden_size].float()
        ss = self.sumsq[slot, :, :p.norm_producers(slot)].sum(-1, keepdim=True)
        return self.x * torch.rsqrt(ss / p.hidden_size + p.rms_norm_eps) * w

    def finished(self, slot: int, t0: int, t1: int, tile: int) -> None:
        """Records the sums of squares of x[:, t0:t1], just finished, for version `slot`'s norm."""
        self.sumsq[slot, :, t0 // tile] = self.x[:, t0:t1].pow(2).sum(-1)

    def rope(self, y: torch.Tensor, j0: int = 0) -> torch.Tensor:
        """LlamaModel._rope on [B, 2n] rows at each row's position (half-rotation layout): the rotation
        pairs j0 .. j0 + n of a head (all of it by default)."""
        half = y.shape[-1] // 2
        angle = self.positions.to(torch.float32)[:, None] * self.inv_freq[None, j0:j0 + half]
        cos, sin = angle.cos(), angle.sin()
        y1, y2 = y[:, :half], y[:, half:]
        return torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), dim=-1)

    def slots(self, b: int, lo: int, hi: int) -> torch.Tensor:
        """Cache slots of tokens [lo, hi) of row b, through its block table."""
        bs = self.plan.block_size
        t = torch.arange(lo, hi, device=self.block_tables.device)
        return self.block_tables[b, t // bs] * bs + t % bs


# -- one function per opcode: (views, layer, t0, t1, w_off, n_off) ---------------------------------
def _embed(m: _Views, layer: int, t0: int, t1: int, w_off: int, n_off: int) -> None:
    Hd = m.plan.hidden_size
    idx = w_off + m.tokens[:, None] * Hd + torch.arange(t0, t1, device=m.tokens.device)[None, :]
    m.x[:, t0:t1] = m.W[idx].float()
    m.finished(0, t0, t1, m.plan.tiles.embed)


def _qkv_rope(m: _Views, layer: int, t0: int, t1: int, w_off: int, n_off: int) -> None:
    """Rotation pairs [t0, t1) of one head: rows j and j + D/2 of it for j in [j0, j1)."""
    p = m.plan
    H, KVH, D = p.num_heads, p.num_kv_heads, p.head_dim
    half = D // 2
    head, j0, j1 = t0 // half, t0 % half, t0 % half + (t1 - t0)
    qkv = m.matrix(w_off, (H + 2 * KVH) * D, p.hidden_size)
    rows = torch.cat((qkv[head * D + j0:head * D + j1], qkv[head * D + half + j0:head * D + half + j1])).float()
    y = m.normed_x(n_off, 2 * layer) @ rows.T            # [B, 2 (j1 - j0)]: the pairs' first, then second halves
    if head < H + KVH:
        y = m.rope(y, j0)
    y1, y2 = y[:, :j1 - j0], y[:, j1 - j0:]
    if head < H:
        m.q[:, head, j0:j1] = y1
        m.q[:, head, half + j0:half + j1] = y2
        return
    cache, kvh = (m.k, head - H) if head < H + KVH else (m.v, head - H - KVH)
    for b, slot in enumerate(m.write_slots.tolist()):
        if slot >= 0:
            cache[layer, slot, kvh, j0:j1] = y1[b].to(cache.dtype)
            cache[layer, slot, kvh, half + j0:half + j1] = y2[b].to(cache.dtype)


def _attn_split(m: _Views, layer: int, t0: int, t1: int, w_off: int, n_off: int) -> None:
    p = m.plan
    g, s, G, P = t0, t1, p.group, p.tiles.partition
    heads = slice(g * G, (g + 1) * G)
    for b, ctx in enumerate(m.context_lens.tolist()):
        lo, hi = s * P, min((s + 1) * P, ctx)
        if lo >= hi:
            m.part_m[b, heads, s] = -math.inf
            m.part_l[b, heads, s] = 0.0
            m.part_acc[b, heads, s] = 0.0
            continue
        slots = m.slots(b, lo, hi)
        keys = m.k[layer, slots, g].float()              # [n, D]
        values = m.v[layer, slots, g].float()
        scores = (m.q[b, heads] @ keys.T) / math.sqrt(p.head_dim)   # [G, n]
        mx = scores.max(-1).values
        e = torch.exp(scores - mx[:, None])
        m.part_m[b, heads, s] = mx
        m.part_l[b, heads, s] = e.sum(-1)
        m.part_acc[b, heads, s] = e @ values


def _attn_reduce(m: _Views, layer: int, t0: int, t1: int, w_off: int, n_off: int) -> None:
    """The merge of kv head t0's splits, run by the group's last split (no plan row carries it)."""
    p = m.plan
    G, D, P = p.group, p.head_dim, p.tiles.partition
    for b, ctx in enumerate(m.context_lens.tolist()):
        used = -(-ctx // P)
        ms = m.part_m[b, t0 * G:(t0 + 1) * G, :used]        # [G, used]
        scale = torch.exp(ms - ms.max(-1, keepdim=True).values)
        num = (scale[..., None] * m.part_acc[b, t0 * G:(t0 + 1) * G, :used]).sum(1)   # [G, D]
        den = (scale * m.part_l[b, t0 * G:(t0 + 1) * G, :used]).sum(-1)
        m.attn[b, t0 * G * D:(t0 + 1) * G * D] = (num / den[:, None]).reshape(-1)


def _o_proj(m: _Views, layer: int, t0: int, t1: int, w_off: int, n_off: int) -> None:
    p = m.plan
    wo = m.matrix(w_off, p.hidden_size, p.num_heads * p.head_dim)[t0:t1].float()
    m.x[:, t0:t1] += m.attn @ wo.T
    m.finished(2 * layer + 1, t0, t1, p.tiles.o)


def _gate_up(m: _Views, layer: int, t0: int, t1: int, w_off: int, n_off: int) -> None:
    p = m.plan
    Fd = p.intermediate_size
    wgu = m.matrix(w_off, 2 * Fd, p.hidden_size)
    h = m.normed_x(n_off, 2 * layer + 1)
    gate = h @ wgu[t0:t1].float().T
    up = h @ wgu[Fd + t0:Fd + t1].float().T
    m.act[:, t0:t1] = F.silu(gate) * up


def _down(m: _Views, layer: int, t0: int, t1: int, w_off: int, n_off: int) -> None:
    p = m.plan
    wd = m.matrix(w_off, p.hidden_size, p.intermediate_size)[t0:t1].float()
    m.x[:, t0:t1] += m.act @ wd.T
    m.finished(2 * layer + 2, t0, t1, p.tiles.down)


def _lm_head(m: _Views, layer: int, t0: int, t1: int, w_off: int, n_off: int) -> None:
    p = m.plan
    wlm = m.matrix(w_off, p.vocab_size, p.hidden_size)[t0:t1].float()
    m.logits[:, t0:t1] = m.normed_x(n_off, 2 * p.num_layers) @ wlm.T
    j = t0 // p.tiles.lm_head
    best = m.logits[:, t0:t1].max(-1)     # torch returns the first maximal index
    m.lm_max[:, j] = best.values
    m.lm_idx[:, j] = (best.indices + t0).float()


def _argmax(m: _Views, layer: int, t0: int, t1: int, w_off: int, n_off: int) -> None:
    """The best of the LM-head tiles' partials: the largest value, the lowest index among ties."""
    top = m.lm_max.max(-1, keepdim=True).values
    idx = torch.where(m.lm_max == top, m.lm_idx, torch.full_like(m.lm_idx, float(m.plan.vocab_size)))
    m.next_tokens.copy_(idx.min(-1).values.long())


_EXEC: dict[Op, Callable[..., None]] = {
    Op.EMBED: _embed, Op.QKV_ROPE: _qkv_rope, Op.ATTN_SPLIT: _attn_split,
    Op.O_PROJ: _o_proj, Op.GATE_UP: _gate_up, Op.DOWN: _down, Op.LM_HEAD: _lm_head, Op.ARGMAX: _argmax,
}


@torch.inference_mode()
def run_plan(plan: Plan, W: torch.Tensor, A: torch.Tensor, I: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             inv_freq: torch.Tensor, E: torch.Tensor | None = None) -> None:
    """Executes the plan's tasks in order over the flat buffers, checking each wait before the task runs
    (PlanError when an event has not reached its count: the plan's order is broken) and signalling after.
    As in the kernel, the ATTN_SPLIT whose signal completes its event's count (the group's last split)
    then merges the group (ATTN_REDUCE) and signals the row's AUX event.
    `E` defaults to fresh zeroed counters; pass a zeroed one to inspect the final counts."""
    if E is None:
        E = torch.zeros(plan.num_events, dtype=torch.int32)
    views = _Views(plan, W, A, I, k, v, inv_freq)
    counts = E.tolist()      # mirrored on the host: one read per task would dominate on a GPU
    for i, r in enumerate(plan.tasks.tolist()):
        if r[WAIT_EV] >= 0 and counts[r[WAIT_EV]] < r[WAIT_COUNT]:
            raise PlanError(f"{describe_task(plan, i)} waits for {r[WAIT_COUNT]} signals of event "
                            f"'{plan.event_names[r[WAIT_EV]]}' but only {counts[r[WAIT_EV]]} arrived before it")
        _EXEC[Op(r[OP])](views, r[LAYER], r[T0], r[T1], r[W_OFF], r[N_OFF])
        counts[r[SIG_EV]] += 1
        if r[OP] == Op.ATTN_SPLIT and counts[r[SIG_EV]] == plan.event_counts[r[SIG_EV]]:
            _attn_reduce(views, r[LAYER], r[T0], r[T0] + 1, -1, -1)
            counts[r[AUX]] += 1
    E.copy_(torch.tensor(counts, dtype=torch.int32))


class PlanDecoder:
    """Decode steps of a Llama-family model through plans run by the VM: the same interface as
    `GraphDecoder`. One plan per batch bucket (powers of two up to `max_batch`); a step with fewer
    sequences is padded with rows that write no KV. A `Decoder`, not registered: a test reference."""

    name: ClassVar[str] = "vm"
    device_greedy: ClassVar[bool] = True

    @classmethod
    def unsupported(cls, model) -> str | None:
        return supports(model)

    def __init__(self, model: LlamaModel, kv: PagedKVCache, max_batch: int = 8, max_context: int | None = None,
                 tiles: TileConfig | None = None):
        self.model, self.kv, self.max_batch, self.tiles = model, kv, max_batch, tiles or TileConfig()
        self.max_context = max_context or min(model.cfg.max_position_embeddings, kv.capacity_tokens)
        self.W, self.layout = pack_weights(model, torch.float32, "cpu")
        self.inv_freq = model.inv_freq.to("cpu", torch.float32)
        self._plans: dict[int, tuple[Plan, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.next_tokens: torch.Tensor | None = None    # the last step's greedy tokens (ARGMAX)

    def bucket(self, batch: int) -> int:
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside [1, {self.max_batch}]")
        return min(1 << (batch - 1).bit_length(), self.max_batch)

    def plan_for(self, batch: int) -> tuple[Plan, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(plan, A, I, E) of the bucket holding `batch`, compiled on first use."""
        size = self.bucket(batch)
        if size not in self._plans:
            plan = compile_plan(self.model.cfg, size, self.max_context, self.kv.block_size, self.layout, self.tiles)
            self._plans[size] = (plan, *new_buffers(plan))
        return self._plans[size]

    @torch.inference_mode()
    def forward(self, step: StepInput, tokens_only: bool = False) -> torch.Tensor:
        """Logits [len(step.logits_rows), V] (float32) of one decode step (with `tokens_only` their
        greedy tokens); the greedy tokens of every row also in `next_tokens`."""
        B = int(step.token_ids.shape[0])
        plan, A, I, E = self.plan_for(B)
        fill_inputs(plan, I, step, self.kv.block_size)
        E.zero_()
        run_plan(plan, self.W, A, I, self.kv.k, self.kv.v, self.inv_freq, E)
        n = plan.ints.next_tokens
        self.next_tokens = I[n:n + B].clone()
        if tokens_only:
            return self.next_tokens.index_select(0, step.logits_rows.cpu())
        lo = plan.acts.logits
        logits = A[lo:lo + B * plan.vocab_size].view(B, plan.vocab_size)
        return logits.index_select(0, step.logits_rows.cpu()).clone()
