"""The CPU decode step as one native call: a persistent thread team runs the step's task table.

`cpu_plan.py` lowers a decode step (one new token per row) into tile tasks linked by event counters;
`kernels/cpu/step.c` runs them on a persistent team of threads (one per core, the caller included)
with no fork/join barrier between operators. Two kinds of products:

- fast (default): activations quantized per group of 32 to int8, integer dot products (AVX2
  `maddubs`, AVX-512/AVX-VNNI `vpdpbusd`, NEON `sdot`), as llama.cpp does;
- exact (`exact=True`, `--exact`): fp32 activations against the packed weights, the eager step's
  maths up to summation order (greedy tokens identical to transformers on the default model).

Prompt chunks of up to `prefill_tokens` tokens run here too, one row per token (the engine sends the
short chunks that sit beside running decodes; on AMX machines whole chunks of up to 512 tokens, whose
products run on tiles); longer prompts run on the eager path
(`LlamaModel.forward`, BLAS), which is also the reference this runtime is tested against.
"""
from __future__ import annotations

import ctypes
import itertools
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from slipstream.kernels.cpu import load_library
from slipstream.kernels.cpu.abi import ACT_GELU_TANH, ACT_SILU, SSAct, SSLayer, SSMat, SSModel, SSMoe, SSStep
from slipstream.kv.blocks import HybridKVCache
from slipstream.runtime import cpu_plan
from slipstream.runtime.cpu_load import NeighbourLoad, team_size
from slipstream.step import DecodeRows
from slipstream.weights.moe import MoeLayer

# the KV cache's element types the step reads and writes, numbered as ops.h's SSLayer.kv_type: fp32; fp16 (K and
# V rounded to half precision when stored, widened in registers when attention reads them: half the bytes
# attention streams); int8 (codes with a float32 scale per row in the cache's scale planes)
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.int8: 2}


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def default_threads() -> int:
    """One thread per core this process may run on (SLIPSTREAM_THREADS overrides)."""
    env = os.environ.get("SLIPSTREAM_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # not Linux
        return max(1, os.cpu_count() or 1)


def _unhandled(c: Any) -> str | None:
    """A feature of config `c` this step does not compute (None: it computes them all). It computes
    Gemma 2/3's (GELU GLU, post-norms, scaled embedding, sliding-window layers with their own RoPE
    base, a query scale, soft-capping), Phi-3's (LongRoPE, partial rotary) and Qwen2/3-MoE's (softmax
    top-k routing, optionally renormalised; a shared expert behind a sigmoid gate)."""
    if getattr(c, "num_experts", None):
        if c.moe_intermediate_size % 32 or (c.shared_expert_intermediate_size or 0) % 32:
            return "expert sizes that are not multiples of 32"
    if c.hidden_act not in ("silu", "gelu_tanh"):
        return f"a {c.hidden_act} GLU"
    if c.rope_dim % 2:
        return "an odd number of rotary dimensions"
    kind = (c.rope_scaling or {}).get("rope_type", (c.rope_scaling or {}).get("type"))
    if kind not in (None, "default", "linear", "llama3", "longrope"):
        return f"{kind} RoPE scaling"
    return None


# weights stored as floats (GGUF's F16 and BF16 kept as the file has them; dense fp32 has fmt None): no integer codes
_FLOAT_FORMATS = (1, 30)


def _row_parts(model: Any) -> list[tuple[Any, float]]:
    """Every stored part of a prompt row's layer products with its multiply-adds per row: n x k, and for a routed
    expert n x k x top-k / experts (a row runs its top-k experts only). A prompt chunk computes the LM head for its
    output rows only: not counted."""
    out = []
    for L in model.layers:
        routed = {id(w) for w in (*getattr(L, "experts_gate_up", ()), *getattr(L, "experts_down", ()))}
        share = model.cfg.num_experts_per_tok / model.cfg.num_experts if routed else 1.0
        for lin in L.linears():
            f = share if id(lin) in routed else 1.0
            out += [(p, p.n * p.k * f) for p in (lin.parts or (lin,))]
    return out


def code_share(model: Any) -> float:
    """The share of a prompt row's multiply-adds (its layers' products, `_row_parts`) whose weights are
    integer codes (every quantized type), which the fast path multiplies with integer dot products; F16/BF16
    and dense fp32 weights run one row at a time there, where the eager BLAS step tiles them far better."""
    parts = _row_parts(model)
    total = sum(macs for _, macs in parts)
    coded = sum(macs for p, macs in parts if p.packed and p.fmt not in _FLOAT_FORMATS)
    return coded / total if total else 0.0


def half_float_share(model: Any) -> float:
    """The share of a prompt row's multiply-adds (`_row_parts`) whose weights are 16-bit floats as a GGUF file
    holds them (F16, BF16)."""
    parts = _row_parts(model)
    total = sum(macs for _, macs in parts)
    half = sum(macs for p, macs in parts if p.packed and p.fmt in _FLOAT_FORMATS)
    return half / total if total else 0.0


def long_chunks_native(lib: Any, model: Any) -> bool:
    """Whether the fast path takes whole prompt chunks (`CpuTeamDecoder.prefill_tokens_long`) on the native step
    rather than the eager BLAS step, by what this CPU was measured to do faster (docs/BENCHMARKS.md):
    - AMX machines: where the tiles take nearly all of the products (`tile_share`); the eager step runs the
      others in bf16 on oneDNN's tiles, faster than the vector kernels;
    - x86 without AMX (AVX2, AVX-512 VNNI builds): every quantized model (`code_share`): a 512-token chunk
      of the default model 270 ms native against 670 eagerly in fp32 on the Zen 5 EPYC (350 against 690 for
      the x86-64-v3 build), 0.63-0.78x for Q3_K_M, IQ4_XS, Q5_0, Q6_K files; an F16 file 2.6x slower native;
    - elsewhere (NEON, the portable branch): not measured; the eager step."""
    if lib.ss_amx_active():
        return tile_share(model) >= CpuTeamDecoder.prefill_tile_share
    x86 = lib.ss_isa().decode().startswith(("avx2", "avx512"))
    return x86 and code_share(model) >= CpuTeamDecoder.prefill_tile_share


def bf16_blas_fast(lib: Any) -> bool:
    """Whether torch's CPU GEMM (oneDNN) multiplies bf16 in hardware here: AMX tiles, or AVX-512 BF16
    (`vdpbf16ps`: Zen 4/5, Cooper Lake). There the fast path's eager prompt step runs in bf16 (~7x fp32's products
    on AMX; F16/BF16 files' chunks 1.5-2.3x faster on the Zen 4 EPYC: docs/BENCHMARKS.md); elsewhere oneDNN would
    emulate bf16, slower than fp32."""
    if lib.ss_amx_active():
        return True
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)   # torch's own CPUID reading
    return bool(probe()) if probe is not None else False


def tile_share(model: Any) -> float:
    """The share of a prompt row's multiply-adds (its layers' products: a prompt chunk computes the LM head for
    its output rows only) whose weights are in the 4- and 8-bit layouts the AMX tiles take (Q4_0, Q4_1, Q4_K,
    Q8_0). The other types (Q5_K, Q6_K, ... kept as re-blocked or raw GGUF blocks) run the vector kernels 8
    prompt rows at a time."""
    parts = _row_parts(model)
    total = sum(macs for _, macs in parts)
    tiled = sum(macs for p, macs in parts if p.packed and not p.blocks)
    return tiled / total if total else 0.0


class RopeTable:
    """cos and sin of the rotary angles of positions 0..len-1 (float32 [P, rotary / 2] numpy arrays, grown
    by doubling): a step's rows are looked up instead of computed, the same values (each entry is
    cos(float32(p) * inv_freq[j]) either way) for a row copy instead of four tensor ops per step."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.cos = self.sin = np.zeros((0, int(self.inv_freq.numel())), dtype=np.float32)
        self.cos_addr = self.sin_addr = 0
        self.row_bytes = 4 * int(self.inv_freq.numel())

    def cover(self, end: int) -> None:
        """Make positions up to `end` - 1 present."""
        if end > len(self.cos):
            n = max(end, 2 * len(self.cos), 256)
            freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            self.cos, self.sin = freqs.cos().numpy(), freqs.sin().numpy()
            self.cos_addr, self.sin_addr = self.cos.ctypes.data, self.sin.ctypes.data

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of `positions` ([T] integers) as contiguous [T, rotary / 2] tensors."""
        idx = positions.to(torch.int64)
        self.cover(int(idx.max()) + 1 if idx.numel() else 0)
        if idx.numel() and int(idx.min()) < 0:
            raise ValueError("negative positions")
        return torch.from_numpy(self.cos)[idx], torch.from_numpy(self.sin)[idx]


class _Act:
    """An activation's fp32 rows with the fast path's int8 codes, scales and sums."""
    def __init__(self, rows: int, k: int):
        self.f = torch.zeros(rows, k, dtype=torch.float32)
        self.q = torch.zeros(rows, k, dtype=torch.int8)
        self.d = torch.zeros(rows, max(1, k // 32), dtype=torch.float32)
        self.s = torch.zeros(rows, max(1, k // 32), dtype=torch.float32)
        # the codes again, paired for the AVX2 q4 product, and their scales four times each
        self.p = torch.zeros(rows, k, dtype=torch.int8)
        self.e = torch.zeros(rows, 4 * max(1, k // 32), dtype=torch.float32)

    def struct(self) -> SSAct:
        return SSAct(self.f.data_ptr(), self.q.data_ptr(), self.d.data_ptr(), self.s.data_ptr(), self.p.data_ptr(),
                     self.e.data_ptr())


class _Buffers:
    """The step's activations for up to `rows` rows and logits for up to `out_rows` of them (allocated once
    per size, reused every step; a step of fewer rows uses their first rows). Logits are sized apart: a
    512-token prompt chunk wants one row of them, not 512 (100 MB for a 49K vocabulary)."""
    def __init__(self, dec: CpuTeamDecoder, rows: int, out_rows: int):
        c = dec.model.cfg
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        f32 = torch.float32
        self.rows, self.out_rows = rows, out_rows
        self.x = torch.zeros(rows, c.hidden_size, dtype=f32)
        self.h = _Act(rows, c.hidden_size)
        self.qkv = torch.zeros(rows, (H + 2 * KVH) * D, dtype=f32)
        self.attn = _Act(rows, H * D)
        self.act = _Act(rows, c.intermediate_size)
        self.logits = torch.zeros(out_rows, c.vocab_size, dtype=f32)
        self.next_tokens = torch.zeros(out_rows, dtype=torch.int64)
        self.tmp = torch.zeros(rows, c.hidden_size, dtype=f32) if dec.shape.post_norms else None
        e = dec.shape.moe
        if e is not None:   # the MoE layers' router outputs, (expert, row) pairs and expert activations
            pairs = rows * e.topk
            self.router = torch.zeros(rows, e.experts, dtype=f32)
            self.sgate = torch.zeros(rows, dtype=f32)
            self.moe_idx = torch.zeros(2 * e.experts + 2 + pairs, dtype=torch.int32)
            self.pair_w = torch.zeros(pairs, dtype=f32)
            self.hx = _Act(pairs, c.hidden_size)
            self.eact = _Act(pairs, e.ffn)
            self.sact = _Act(rows, max(32, e.shared_ffn))
        # the fields that never change between steps, built once (ctypes structs are copied into SSStep)
        self.fixed = (self.h.struct(), self.qkv.data_ptr(), self.attn.struct(), self.act.struct(),
                      self.logits.data_ptr(), self.next_tokens.data_ptr())
        self.moe_fields = self.moe_args()
        self.logits_np, self.next_tokens_np = self.logits.numpy(), self.next_tokens.numpy()
        # `forward_rows`' inputs, filled in place each step, and its SSStep (the fixed fields set once)
        half = dec._rope.cos.shape[1]
        self.tokens_np = np.zeros(rows, dtype=np.int64)
        self.write_np = np.zeros(rows, dtype=np.int64)
        self.starts_np = np.zeros(rows + 1, dtype=np.int64)
        self.out_rows_np = np.arange(out_rows, dtype=np.int64)
        self.cos_np, self.sin_np = np.zeros((rows, half), np.float32), np.zeros((rows, half), np.float32)
        local = dec._rope_local is not None   # Gemma 3's sliding layers' own rotary rows
        self.cos_l_np, self.sin_l_np = (np.zeros((rows if local else 0, half), np.float32) for _ in range(2))
        self.slots_np = np.zeros(0, dtype=np.int64)
        self.slots_addr = 0
        self.cos_addr, self.sin_addr = self.cos_np.ctypes.data, self.sin_np.ctypes.data
        self.cos_l_addr, self.sin_l_addr = self.cos_l_np.ctypes.data, self.sin_l_np.ctypes.data
        self.args = SSStep(0, 0, self.tokens_np.ctypes.data, self.write_np.ctypes.data, None,
                           self.starts_np.ctypes.data, None, None, self.x.data_ptr(), *self.fixed, 0, 0,
                           self.out_rows_np.ctypes.data, None, None, _ptr(self.tmp), *self.moe_fields, None, None)

    def moe_args(self) -> tuple:
        """SSStep's MoE fields (nulls for a dense model)."""
        if not hasattr(self, "router"):
            return (None, None, None, None, SSAct(), SSAct(), SSAct())
        return (self.router.data_ptr(), self.sgate.data_ptr(), self.moe_idx.data_ptr(), self.pair_w.data_ptr(),
                self.hx.struct(), self.eact.struct(), self.sact.struct())


class CpuTeamDecoder:
    """Steps of a Llama-family model (decode rows, short prompt chunks) as one native call each."""

    name = "native"
    device_greedy = True   # picks greedy tokens itself (no logits copy) when asked to

    def __init__(self, model: Any, kv: Any, exact: bool = False, threads: int | None = None):
        why = self.unsupported(model)
        if why is not None:
            raise RuntimeError(why)
        kv_dtype = kv.k.dtype
        # Gemma's hybrid cache: the sliding layers keep their window in parts of their own (kv.blocks)
        self._hybrid = isinstance(kv, HybridKVCache)
        caches = [kv.layer_cache(i) for i in range(model.cfg.num_layers)]
        if kv_dtype not in KV_TYPES or kv.v.dtype != kv_dtype or {kv.k.device.type, kv.v.device.type} != {"cpu"}:
            raise RuntimeError("the native runtime needs a float32, float16 or int8 KV cache on the CPU")
        self.lib = load_library()
        self.model = model
        self.kv = kv
        self.exact = bool(exact)
        self._vocab = int(model.embed.n)   # the embedding's rows: the native lookup trusts its token ids
        # how the eager prompt step (chunks longer than prefill_tokens) multiplies (weights.quant.blas_mode): the
        # exact path row by row alike whatever the batch; the fast path in bf16 where the CPU multiplies bf16
        bf16 = bf16_blas_fast(self.lib) and os.environ.get("SLIPSTREAM_EAGER_BF16", "1") != "0"
        self.eager_blas = "fp32-fixed" if self.exact else "bf16" if bf16 else "fp32"
        if not self.exact and long_chunks_native(self.lib, model):
            self.prefill_tokens = self.prefill_tokens_long
        elif not self.exact and code_share(model) <= 1 - self.prefill_tile_share:
            # float weights: the step runs their rows one at a time (the default model's F16 file on the Sapphire
            # Rapids Xeon: ~5-6 ms a prompt row; dense fp32 weights, an HF checkpoint, ~3 ms), the eager BLAS step a
            # chunk in ~45-70 ms + ~1 ms a row in bf16 (benchmarks/prompt_sizes.py, docs/BENCHMARKS.md): chunks from
            # `float_eager_from` tokens on go there (from `dense_eager_from` for dense fp32 weights, and for
            # F16/BF16 weights where the eager step multiplies in fp32: 1.5-2.3x slower than in bf16 on the Zen 4 EPYC)
            half = half_float_share(model) >= self.prefill_tile_share and self.eager_blas == "bf16"
            start = self.float_eager_from if half else self.dense_eager_from
            self.prefill_tokens = start - 1
            self.eager_dense_from_rows = start
        spin = [int(v) for v in os.environ.get("SLIPSTREAM_SPIN_US", "-1,-1").split(",")][:2]
        # threads of the team; microseconds a waiting thread spins before it sleeps (in a step, between steps)
        self.threads = self.lib.ss_team_configure(threads or default_threads(), *(spin + [-1, -1])[:2])
        # the team shrinks while other processes keep cores busy, and grows back (cpu_load.py);
        # SLIPSTREAM_ADAPTIVE_THREADS=0 keeps it at `threads`
        self.active_threads = self.threads
        self._cores = max(self.threads, default_threads())   # a team asked for more threads than cores
        adaptive = os.environ.get("SLIPSTREAM_ADAPTIVE_THREADS", "1") != "0" and self.threads > 1
        self._neighbours = NeighbourLoad() if adaptive else None
        c = model.cfg
        layers = model.layers
        lm = model.lm_head
        moe_layers = tuple(i for i, L in enumerate(layers) if isinstance(L, MoeLayer))
        moe = None
        if moe_layers:
            moe = cpu_plan.MoeShape(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                                    c.shared_expert_intermediate_size or 0)
        self.shape = cpu_plan.Shape(
            c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size or 32,
            c.vocab_size, post_norms=layers[0].post_attn_norm is not None, moe=moe, moe_layers=moe_layers)
        self._moe = [self._moe_struct(L) if isinstance(L, MoeLayer) else None for L in layers]
        # the C side keeps raw pointers: these objects keep what they point to alive
        self._layers = (SSLayer * c.num_layers)(*[
            SSLayer(L.qkv.ss_mat(), L.o.ss_mat(), *((SSMat(), SSMat()) if isinstance(L, MoeLayer)
                                                    else (L.gate_up.ss_mat(), L.down.ss_mat())),
                    _ptr(L.attn_norm), _ptr(L.ffn_norm), _ptr(L.q_norm),
                    _ptr(L.k_norm), caches[i][0].data_ptr(), caches[i][1].data_ptr(),
                    _ptr(L.post_attn_norm), _ptr(L.post_ffn_norm),
                    (c.sliding_window or 0) if c.is_sliding(i) else 0,
                    int(c.is_sliding(i) and model.inv_freq_local is not None), KV_TYPES[kv_dtype],
                    int(caches[i][2]),
                    self._moe_ptr(i), *self._kv_scales(kv, i))
            for i, L in enumerate(layers)])
        act = ACT_GELU_TANH if c.hidden_act == "gelu_tanh" else ACT_SILU
        scale = c.attn_scale if c.attn_scale is not None else c.head_dim ** -0.5
        self._model = SSModel(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                              c.intermediate_size, c.vocab_size, act, c.rms_norm_eps, scale,
                              self._layers, model.embed.ss_mat(), lm.ss_mat(), model.norm.data_ptr(),
                              float(c.embed_scale or 0.0), c.rope_dim, float(c.attn_softcap or 0.0),
                              float(c.final_softcap or 0.0), 0)
        self._bufs: _Buffers | None = None
        self._rope = RopeTable(model.inv_freq)
        self._rope_local = None if model.inv_freq_local is None else RopeTable(model.inv_freq_local)
        self._arange = np.zeros(0, dtype=np.int64)   # slot ids 0, 1, ...: a range read points into it
        self._ids_addr = 0
        # task tables by (rows, output rows, argmax), validated once each; the most recent kept
        self._tables: OrderedDict[tuple[int, int, bool], tuple[np.ndarray, int]] = OrderedDict()
        self._events = np.zeros(0, dtype=np.int32)
        self._events_addr = self._events.ctypes.data

    def _fit_team(self) -> None:
        """Resize the team to the cores the rest of the machine leaves free (at most once per window)."""
        other = self._neighbours.sample() if self._neighbours is not None else None
        if other is None:
            return
        want = team_size(self.threads, self._cores, other)
        if want != self.active_threads:
            self.active_threads = self.lib.ss_team_configure(want, -1, -1)

    @staticmethod
    def _kv_scales(kv: Any, i: int) -> tuple[int | None, int | None]:
        """Model layer i's K and V scale planes (an int8 cache; a hybrid cache's local ones for its sliding
        layers), else NULLs."""
        ks, vs = kv.layer_scales(i)
        if ks is None or vs is None:
            return None, None
        return ks.data_ptr(), vs.data_ptr()

    def _moe_ptr(self, i: int) -> Any:
        st = self._moe[i]
        return None if st is None else ctypes.pointer(st[0])

    def _moe_struct(self, L: MoeLayer) -> tuple[SSMoe, Any, Any]:
        """A MoE layer's SSMoe and the expert arrays it points into (kept alive with it)."""
        c = self.model.cfg
        E = len(L.experts_gate_up)
        gu = (SSMat * E)(*[w.ss_mat() for w in L.experts_gate_up])
        dn = (SSMat * E)(*[w.ss_mat() for w in L.experts_down])
        shared = L.shared_gate_up is not None
        st = SSMoe(L.router.ss_mat(), L.shared_gate_up.ss_mat() if shared else SSMat(),
                   L.shared_down.ss_mat() if shared else SSMat(),
                   L.shared_gate.ss_mat() if L.shared_gate is not None else SSMat(),
                   ctypes.cast(gu, ctypes.POINTER(SSMat)), ctypes.cast(dn, ctypes.POINTER(SSMat)), E,
                   c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size or 0,
                   int(bool(c.norm_topk_prob)), 0)
        return st, gu, dn

    @classmethod
    def unsupported(cls, model: Any) -> str | None:
        """Why this runtime cannot run `model` here, or None. Qwen2/3-MoE models run here too (ROUTE,
        EXPERT_GU, SHARED_GU, MOE_DOWN tasks)."""
        from slipstream.models.llama import LlamaModel
        from slipstream.models.qwen_moe import QwenMoeModel
        if not isinstance(model, (LlamaModel, QwenMoeModel)):
            return "the native runtime runs the Llama family (Llama, Mistral, Qwen2/3, SmolLM2)"
        if load_library() is None:
            return "the native CPU kernels are not available on this machine (no C compiler?)"
        if model.device.type != "cpu":
            return "the native runtime runs on the CPU"
        c = model.cfg
        why = _unhandled(c)
        if why is not None:
            return f"the native runtime does not compute {why}; the eager runtime does"
        if c.head_dim % 2 or c.num_heads % c.num_kv_heads:
            return "the native runtime needs an even head size and whole query groups"
        mats = [w for L in model.layers for w in L.linears()]
        mats += [model.lm_head, model.embed]
        for m in mats:
            if m.packed and m.k % 32:
                return "packed weights need a multiple of 32 input features"
            if not m.packed and (m.data.dtype != torch.float32 or m.data.device.type != "cpu"):
                return "dense weights must be float32 on the CPU for the native runtime"
        if c.intermediate_size % 32 or c.hidden_size % 32:
            return "the native runtime needs hidden and FFN sizes that are multiples of 32"
        return None

    # the most prompt tokens one step takes (see `forward`); longer chunks run eagerly. On AMX machines the
    # step's products of a 512-token chunk run on tiles: 334 ms against ~420-520 for the eager BLAS step
    # (docs/BENCHMARKS.md), so whole prompt chunks come here (__init__)
    # Only where nearly all of a prompt row's products are on tiles (`tile_share`); elsewhere the eager step (bf16
    # on AMX) is faster. Through `serve` (slipstream bench, 800-token prompts, docs/BENCHMARKS.md): a Q6_K file
    # (share 0) TTFT 2437 -> 831 ms eagerly; a Q4_K_M file (0.86) 1047 -> 814 ms, TPOT 9.4 -> 8.9 ms; a Q4_K_S file
    # (0.96) kept on the step, 802 ms against 880 eagerly; the default model (1.0) too
    # Off AMX, on x86, whole chunks of quantized models come here too (`long_chunks_native`): the vector kernels
    # take prompt rows 8 at a time against weight blocks in L1, ~2x the eager fp32 GEMM's speed on the EPYCs
    prefill_tokens = 64
    prefill_tokens_long = 512
    float_eager_from = 16
    dense_eager_from = 32
    prefill_tile_share = 0.9

    def _buffers(self, rows: int, out_rows: int) -> _Buffers:
        b = self._bufs
        if b is None or b.rows < rows or b.out_rows < out_rows:
            b = _Buffers(self, max(rows, 8, b.rows if b else 0), max(out_rows, 8, b.out_rows if b else 0))
            self._bufs = b
        return b

    def _table(self, rows: int, n_out: int, argmax: bool) -> tuple[np.ndarray, int]:
        """The task table of a step (and its address)."""
        key = (rows, n_out, argmax)
        entry = self._tables.get(key)
        if entry is None:
            table = cpu_plan.build(self.shape, rows, self.threads, argmax, out_rows=n_out)
            cpu_plan.validate(table, self.shape, rows)
            self._tables[key] = entry = (table, table.ctypes.data)
            if len(self._tables) > 64:
                self._tables.popitem(last=False)
            if cpu_plan.num_events(table) > len(self._events):
                self._events = np.zeros(cpu_plan.num_events(table), dtype=np.int32)
                self._events_addr = self._events.ctypes.data
        else:
            self._tables.move_to_end(key)
        return entry

    @staticmethod
    def _rows(step: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's context slots, concatenated, and where each row's start ([rows + 1]). A slice of
        several tokens (a prompt chunk) becomes one row per token, token j seeing the slice's context
        up to itself: causal attention as separate rows, the way speculative verification rows are."""
        if all(s.length == 1 for s in step.seqs):   # decode rows only (the usual step): no index arithmetic
            reads = [torch.arange(s.read[0], s.read[1]) if isinstance(s.read, tuple) else s.read for s in step.seqs]
            slots = (torch.cat(reads) if len(reads) > 1 else reads[0]).to(torch.int64).contiguous()
            return slots, torch.tensor([0, *itertools.accumulate(s.context for s in step.seqs)])
        parts, lengths = [], []
        for s in step.seqs:
            first = s.context - s.length + 1           # the first token's context
            if s.length == 1:
                parts.append(torch.arange(s.read[0], s.read[1]) if isinstance(s.read, tuple) else s.read)
                lengths.append(torch.tensor([s.context]))
                continue
            full = torch.arange(s.read[0], s.read[1]) if isinstance(s.read, tuple) else s.read
            ctx = torch.arange(first, s.context + 1)    # each token's context length
            offsets = torch.arange(int(ctx.sum())) - torch.repeat_interleave(torch.cumsum(ctx, 0) - ctx, ctx)
            parts.append(full[offsets])
            lengths.append(ctx)
        slots = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(torch.int64).contiguous()
        ctx_all = torch.cat(lengths) if len(lengths) > 1 else lengths[0]
        starts = torch.zeros(len(ctx_all) + 1, dtype=torch.int64)
        starts[1:] = ctx_all.cumsum(0)
        return slots, starts

    def _run(self, args: SSStep, rows: int, n_out: int, argmax: bool) -> None:
        """One native step over `args` with the task table of its shape, the team fitted to free cores first."""
        table, table_addr = self._table(rows, n_out, argmax)
        self._fit_team()
        self.lib.ss_step(ctypes.byref(self._model), ctypes.byref(args), table_addr, len(table),
                         self._events_addr, len(self._events), int(self.exact))

    def _read_ptr(self, rows: DecodeRows, st: _Buffers) -> int:
        """The address of every row's context slots, concatenated (int64), and `st.starts_np` filled: a lone
        row's slots are read where they are (a sequence's slot ids, or the slot ids 0, 1, ... for a range),
        several rows' are copied into `st.slots_np`."""
        reads = rows.reads
        if len(reads) == 1:
            r = reads[0]
            if isinstance(r, tuple):
                st.starts_np[1] = r[1] - r[0]
                self._ids(r[1])
                return self._ids_addr + 8 * r[0]
            if r.dtype == np.int64 and r.flags.c_contiguous:
                st.starts_np[1] = len(r)
                return r.ctypes.data
        lengths = [r[1] - r[0] if isinstance(r, tuple) else len(r) for r in reads]
        st.starts_np[1:len(reads) + 1] = np.cumsum(lengths)
        total = sum(lengths)
        if len(st.slots_np) < total:
            st.slots_np = np.zeros(max(total, 2 * len(st.slots_np)), dtype=np.int64)
            st.slots_addr = st.slots_np.ctypes.data
        o = 0
        for r, n in zip(reads, lengths):
            st.slots_np[o:o + n] = self._ids(r[1])[r[0]:r[1]] if isinstance(r, tuple) else r
            o += n
        return st.slots_addr

    def _ids(self, end: int) -> np.ndarray:
        """The slot ids 0 .. at least `end` - 1 (grown by doubling)."""
        if len(self._arange) < end:
            self._arange = np.arange(max(end, 2 * len(self._arange), 4096), dtype=np.int64)
            self._ids_addr = self._arange.ctypes.data
        return self._arange

    def forward_rows(self, rows: DecodeRows, tokens_only: bool = False) -> torch.Tensor | list[int]:
        """`forward` of a decode step given as lists (every row's output; with `tokens_only` the greedy
        tokens as a list): the same native call, its arrays filled in place and the rotary rows looked up,
        with no tensor built per step (addresses are kept as ints: numpy's `.ctypes` costs microseconds)."""
        B = len(rows.token_ids)
        if B == 0:
            raise ValueError("an empty step")
        if not len(rows.positions) == len(rows.write_slots) == len(rows.reads) == B:
            raise ValueError("the step's lists differ in length")
        if self._hybrid or self.model.longrope is not None:
            out = self.forward(rows.step(), tokens_only)
            return out.tolist() if tokens_only else out
        if min(rows.positions) < 0:
            raise ValueError("negative positions")
        if min(rows.token_ids) < 0 or max(rows.token_ids) >= self._vocab:
            raise ValueError(f"a token id outside the vocabulary [0, {self._vocab})")
        st = self._buffers(B, B)
        rope, local = self._rope, self._rope_local
        rope.cover(max(rows.positions) + 1)
        if local is not None:
            local.cover(len(rope.cos))
        a = st.args
        a.rows = a.n_out = B
        if B == 1:   # the rotary rows where they are in the table
            at = int(rows.positions[0]) * rope.row_bytes
            st.tokens_np[0], st.write_np[0] = rows.token_ids[0], rows.write_slots[0]
            a.cos, a.sin = rope.cos_addr + at, rope.sin_addr + at
            if local is not None:
                at = int(rows.positions[0]) * local.row_bytes
                a.cos_local, a.sin_local = local.cos_addr + at, local.sin_addr + at
        else:
            st.tokens_np[:B], st.write_np[:B] = rows.token_ids, rows.write_slots
            np.take(rope.cos, rows.positions, axis=0, out=st.cos_np[:B])
            np.take(rope.sin, rows.positions, axis=0, out=st.sin_np[:B])
            a.cos, a.sin = st.cos_addr, st.sin_addr
            if local is not None:
                np.take(local.cos, rows.positions, axis=0, out=st.cos_l_np[:B])
                np.take(local.sin, rows.positions, axis=0, out=st.sin_l_np[:B])
                a.cos_local, a.sin_local = st.cos_l_addr, st.sin_l_addr
        a.read_slots = self._read_ptr(rows, st)
        self._run(a, B, B, tokens_only)
        if tokens_only:
            return st.next_tokens_np[:B].tolist()
        return torch.from_numpy(st.logits_np[:B].copy())   # a numpy copy: see `forward`

    @torch.inference_mode()
    def forward(self, step: Any, tokens_only: bool = False) -> torch.Tensor:
        """Logits (float32) of the step's `logits_rows`; with `tokens_only` just their greedy tokens
        (int64; lowest index on ties, as torch's argmax). Decode rows and prompt chunks alike, one row
        per token: the final norm and LM head run over the `logits_rows` only."""
        B = int(step.token_ids.shape[0])
        if sum(s.length for s in step.seqs) != B:
            raise ValueError("the step's slices do not cover its rows")
        out_rows = step.logits_rows.to(torch.int64).contiguous()
        n_out = int(out_rows.numel())
        st = self._buffers(B, n_out)
        m = self.model
        tokens = step.token_ids.to(torch.int64).contiguous()
        if B and (int(tokens.min()) < 0 or int(tokens.max()) >= self._vocab):
            raise ValueError(f"a token id outside the vocabulary [0, {self._vocab})")
        if m.longrope is not None:   # Phi-3: each sequence's factors (short or long), scaled; first halves
            cos_t, sin_t = m.longrope.tables(step)
            half = cos_t.shape[-1] // 2
            cos, sin = cos_t[:, 0, :half].contiguous(), sin_t[:, 0, :half].contiguous()
        else:
            cos, sin = self._rope.rows(step.positions)
        cos_l = sin_l = None
        if self._rope_local is not None:   # Gemma 3's sliding layers rotate with their own base
            cos_l, sin_l = self._rope_local.rows(step.positions)
        slots, starts = self._rows(step)
        write = step.write_slots.to(torch.int64).contiguous()
        write_l = slots_l = None
        if self._hybrid:
            write_l, slots_l = self.kv.local_slots(write).contiguous(), self.kv.local_slots(slots).contiguous()
        args = SSStep(B, 0, tokens.data_ptr(), write.data_ptr(), slots.data_ptr(), starts.data_ptr(),
                      cos.data_ptr(), sin.data_ptr(), st.x.data_ptr(), *st.fixed,
                      n_out, 0, out_rows.data_ptr(), _ptr(cos_l), _ptr(sin_l), _ptr(st.tmp), *st.moe_fields,
                      _ptr(write_l), _ptr(slots_l))
        self._run(args, B, n_out, tokens_only)
        out = st.next_tokens_np if tokens_only else st.logits_np
        # a numpy copy (one thread): torch's clone runs on its intra-op threads, which wait on this team's
        # spinning threads right after the step (measured ~10 ms per step on the 2-core CPU against ~20 us)
        return torch.from_numpy(out[:n_out].copy())
