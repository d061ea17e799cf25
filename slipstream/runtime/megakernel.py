"""The persistent megakernel runtime: the whole decode step as ONE launch that runs a compiled task plan.

`runtime/plan/` lowers the step into tile-level tasks in topological order, each waiting on an event
counter and signalling one; the Triton kernel (`slipstream/kernels/triton/megakernel.py`, where its
scheduling is described) runs one persistent program per SM over that table. This module holds
what the runtime adds: one plan and its buffers per (batch, context) bucket (`_Static`), the launch
with its epoch-numbered counters (`launch`, `epoch_limit`), the kernel's arguments for a plan
(`scalar_args`, `kernel_constants`), the error check after a step (`check`: a wait that timed out
raises `MegakernelError`), profiling, the offline sm_90a compile, and `MegakernelDecoder`.

Opcode bodies follow `vm.py` (the torch executor and reference) exactly; see `plan/format.py` for
the task table and the buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from slipstream.kernels.triton import megakernel as _kernel
from slipstream.kernels.triton.megakernel import launch_megakernel, megakernel_function
from slipstream.kv.blocks import PagedKVCache
from slipstream.models.llama import LlamaModel
from slipstream.runtime.buckets import BucketedDecoder
from slipstream.runtime.plan import (
    LAYER,
    OP,
    PLAN_VERSION,
    T0,
    T1,
    WAIT_COUNT,
    WAIT_EV,
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
    launch_megakernel(num_programs, num_warps, **ptrs, **scalar_args(p, k.shape[1], epoch, max_spins),
                      **kernel_constants(p, block_k, k.dtype), PROFILE=profile is not None, PREFETCH=prefetch)
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


def kernel_constants(p: Plan, block_k: int | None = None,
                     kv_dtype: torch.dtype = torch.bfloat16) -> dict[str, int | str]:
    """The compile-time constants of the kernel for a plan (one specialisation per model and bucket).
    The K-chunk of each matvec (BK_*) keeps its [batch, tile, K-chunk] accumulator at ACC_ELEMENTS
    (16 float32 registers per thread at 8 warps): wide chunks at batch 1 (more bytes in flight per
    program). Batch 4-8 runs its matvecs on tensor cores (`_mv_dot`, chunks DOT_BK / DOT_BK_NARROW,
    chosen from the compiled spill with Triton 3.6 and 3.9 and the GPU latency model). `block_k`
    forces one chunk for all. `kv_dtype`: the KV cache's dtype (ATTN_SPLIT's tensor-core products)."""
    t = p.tiles
    B = _pow2(p.batch)
    Hd, F, HD = p.hidden_size, p.intermediate_size, p.num_heads * p.head_dim

    def bk(tile: int, k: int, two: bool = False) -> int:
        if block_k:
            return block_k
        if B >= 4 and DOT_TILES and _pow2(tile) >= 16:    # `_mv_dot`: tensor-core tiles
            # 16-row one-matrix tiles (O, DOWN) take 4x the chunk: 64 leaves them latency-bound (modelled
            # dense-1B b4 1562 -> 1173 us); at batch 8 beside 128-row LM tiles that spills 144 bytes (3.6)
            wide = _pow2(tile) <= 16 and not two and (p.batch <= 4 or t.lm_head < 128)
            return max(16, min(DOT_BK_NARROW if wide else DOT_BK, _pow2(k)))
        if B >= 4:    # `_mv_rows`: the smallest chunk whose [TILE, chunk] tile still loads 16 bytes
            return max(16, min(MV_ROWS_ELEMENTS // _pow2(tile), 128, _pow2(k)))   # per thread (8 bf16)
        budget = ACC_ELEMENTS // (2 if two else 1)    # two matrices (gate/up, RoPE halves): two accumulators
        return max(MIN_BK, min(budget // (B * _pow2(tile)), 512, _pow2(k)))
    # the attention merge (in the split's branch since plan version 3) reads half as many splits per step
    # beside the 256-wide K-chunks, the register peak (dense-1B b4: 16 spills 120 bytes with Triton 3.6)
    narrow = B >= 4 and DOT_TILES and DOT_BK_NARROW in (bk(t.o, HD), bk(t.down, F)) and not block_k
    return dict(H=p.num_heads, KVH=p.num_kv_heads, D=p.head_dim, G_PAD=_pow2(p.num_heads // p.num_kv_heads),
                S_BLOCK=min(max(_pow2(p.splits), 2), MERGE_SPLITS // 2 if narrow else MERGE_SPLITS),
                P=t.partition, BLOCK_SIZE=p.block_size,
                BLOCK_B=B, BLOCK_K=block_k or (128 if p.batch <= 2 else 64),
                # a partition's tile: `tl.dot` needs K >= 16 on a GPU (p @ V), the interpreter does not check
                BLOCK_T=max(min(_pow2(t.partition), 64), 16),
                T_EMBED=_pow2(t.embed), T_O=_pow2(t.o), T_GU=_pow2(t.gate_up), T_DOWN=_pow2(t.down),
                T_LM=_pow2(t.lm_head), T_QKV=_pow2(p.head_dim // 2 // t.qkv_parts), BLOCK_V=1024,
                BK_QKV=bk(p.head_dim // 2 // t.qkv_parts, Hd, True), BK_O=bk(t.o, HD), BK_GU=bk(t.gate_up, Hd, True),
                BK_DOWN=bk(t.down, F),
                BK_LM=bk(t.lm_head, Hd), LM_TILE=t.lm_head, TILE_E=t.embed, TILE_O=t.o, TILE_D=t.down,
                NT_PAD=max(_pow2(p.norm_tiles), 2),
                # PREFETCH=1: an O tile read [T_O, PF_K] per spin while the task waits (16 KB at 16 rows)
                PF_K=max(64, min(_pow2(HD), PF_ELEMENTS // _pow2(t.o))),
                # ATTN_SPLIT: the group's query heads padded to a tensor-core tile's rows
                QM=max(16, _pow2(p.num_heads // p.num_kv_heads)),
                # the next ticket drawn as a task begins, and the next task's row loaded before this task's
                # signal (needs the ticket in hand). Off at dense-1B batch 8 (hidden 2048 beside 128-row LM
                # tiles): the live ticket and row take Triton 3.6's spill stack to 96 bytes there (cuobjdump);
                # at hidden 4096 batch 8 it is 32 bytes with 3.6 and 3.9
                TICKET_AHEAD=int(p.batch < 8 or p.hidden_size > 2048),
                ROW_AHEAD=int(p.batch < 8 or p.hidden_size > 2048),
                # float32 KV (the CPU/interpreter tests): exact products; 16-bit KV: the input precision
                DOT_PRECISION="ieee" if kv_dtype == torch.float32 else "tf32")


MV_ROWS_ELEMENTS = 2048   # batch 4-8: weight elements per `_mv_rows` step (8 per thread at 8 warps)
ACC_ELEMENTS = 8192   # 32 float32 registers per thread at 8 warps
DOT_TILES = bool(_kernel.DOT_TILES.value)   # batch 4-8: matvecs on tensor cores (`_mv_dot`), rows padded to 16
DOT_BK = 64     # its K-chunk (128 spills 120 bytes at dense-1B batch 8 with Triton 3.9, 160 with 3.6) ...
DOT_BK_NARROW = 256   # ... and for 16-row one-matrix tiles (Triton 3.6 spill <= 56 bytes where used)
PF_ELEMENTS = 8192   # weight elements per prefetch chunk: one HBM round trip per spin moves 16 KB
MERGE_SPLITS = 16   # splits the attention merge reads per step (half beside 256-wide K-chunks: see below)
MIN_BK = 64   # 8 bf16 per thread along K: what lets the loads be 16 bytes wide


def profile_summary(plan: Plan, prof: torch.Tensor) -> dict:
    """Per-opcode time from the kernel's timestamps: tasks, summed busy and waiting microseconds
    over all programs, and the step's span (first wait to last signal)."""
    t = prof.cpu().double() / 1e3   # ns -> us
    ops = plan.tasks[:, OP].cpu()
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
    fn = megakernel_function()
    names = fn.arg_names
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
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
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
    raise MegakernelError(f"task {err - 1} ({Op(row[OP]).name}, layer {row[LAYER]}, tile {row[T0]}..{row[T1]}) "
                          f"timed out waiting for event {row[WAIT_EV]} "
                          f"({s.plan.event_names[row[WAIT_EV]]}) to reach {row[WAIT_COUNT]}")


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
        if isinstance(plan, (str, Path)):   # from a compiled artifact (an older format's plan: compiled now)
            plan = Plan.load(plan) if Plan.file_version(plan) == PLAN_VERSION else None
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
