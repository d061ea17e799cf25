"""GPU decode speed at real model shapes: HF transformers eager, torch.compile, Slipstream eager,
Slipstream graph and Slipstream megakernel, side by side on the same random weights, against the
memory-bandwidth roofline.

Usage
-----
::

    python benchmarks/gpu_decode.py                       # dense-1B and dense-8B, batch 1, 4, 8
    python benchmarks/gpu_decode.py --shapes dense-1B --batches 1 --paths eager,graph
    python benchmarks/gpu_decode.py --compile-batches 1,8 # torch.compile only at batch 1 and 8
    python benchmarks/gpu_decode.py --tune                # tune the matvec tiles first (minutes)
    python benchmarks/gpu_decode.py --tiny                # CPU smoke test (Triton interpreter)

Options: ``--shapes`` (``dense-1B,dense-8B``), ``--batches`` (``1,4,8``), ``--paths``
(``hf,compile,eager,graph,megakernel``), ``--compile-batches`` (default: ``--batches``),
``--context`` (512), ``--steps`` (64 timed steps per run), ``--warmup`` (8), ``--runs`` (3),
``--block-size`` (16), ``--seed`` (0), ``--tune``, ``--budget`` (seconds; a torch.compile job
starts only if its estimated end is within it, 420), ``--deadline`` (seconds; a watchdog writes the
JSON and exits then, whatever is running, 540), ``--out`` (the JSON; default
``benchmarks/results/gpu_decode_<UTC date>_<gpu>.json``), ``--tiny``.

What is measured
----------------
For each shape (``slipstream/models/random_init.py`` ``SHAPES``: dense-1B = Llama-3.2-1B, dense-8B
= Llama-3.1-8B, rope_theta 500000 without llama3 scaling) ONE set of random bf16 weights is made:
a ``transformers.LlamaForCausalLM`` initialised on the GPU, and Slipstream's ``LlamaModel`` built
from the very same tensors (o, down, embedding and LM head shared; Q/K/V and gate/up concatenated
into Slipstream's fused rows). The B sequences of a batch have random 512-token prompts (the first B
of 8, the same for every path). Slipstream prefills them once with its eager step and gives the graph
and megakernel paths copies of that KV cache; HF prefills its own StaticCache per batch size. Every
path then decodes greedily from position 512 with the same first token (Slipstream eager's prefill
argmax), feeding each chosen token back on the device: no host synchronisation inside the timed
loop. Paths:

* ``hf``: ``model(input_ids, position_ids, past_key_values=StaticCache, ...)`` one token per step
  (plus ``cache_position`` where the installed transformers still takes it), argmax on the device.
  A StaticCache attends over its whole length (512 + steps + 1 slots, masked): that is HF's design.
* ``compile``: the same model's ``forward`` under ``torch.compile(mode="reduce-overhead",
  fullgraph=True)`` (HF's static-cache recipe; CUDA graphs via cudagraph trees), prefill eager.
  Compilation and graph recording are warmed up first and timed separately (``setup_s``). If the
  full graph fails to compile, ``fullgraph=False`` is tried and the error recorded.
* ``eager``: ``LlamaModel.forward(StepInput, PagedKVCache)``; sequence b owns the contiguous blocks
  ``[b*W, (b+1)*W)``, so its slot of position p is ``b*W*block_size + p``.
* ``graph``: ``runtime.graph.GraphDecoder``'s static interface: ``static(B)`` captures the CUDA
  graph, ``fill`` once, then per step ``replay`` and four tiny device ops that feed the chosen
  token back (tokens <- next_tokens, positions, slots and context += 1).
* ``megakernel``: ``runtime.megakernel.MegakernelDecoder``, the same static interface (recorded as
  unavailable if the module does not import).

Each path: one free-running check run of ``--steps`` steps (its greedy tokens are recorded), an
untimed warm-up of ``--warmup`` steps, then ``--runs`` timed runs of ``--steps`` steps, each from
the same state (position 512, the same first token). A run's step time is its elapsed time (CUDA
events around the whole loop) over ``--steps``; the reported step time is the median over runs;
tok/s = B / step time. Every timed run must end on the check run's last token (``repeatable``).
The megakernel's error word (a wait that timed out) is checked after the check run, the warm-up
and every timed run, outside the timing (``checked_runs``): a failed run is an error, not a time.

Token checks (``checks`` in the JSON): graph and megakernel against eager, compile against hf, hf
against eager (information only: HF keeps a bf16 residual stream, Slipstream a float32 one).
``free_running``: the two paths' own greedy sequences, the number of leading steps where every row
agrees and whether all do; random bf16 weights give near-ties, so a late divergence is not by itself
a bug. ``first_step``: the max abs difference of the first decode step's logits (same KV state, same
input token) and the logits' max magnitude. For graph and megakernel also ``forced``: both paths run
in lockstep from the same state for min(steps, 24) steps (crossing a KV block boundary) with the
other path's input forced to eager's token every step; it counts the argmax disagreements (rows x
steps) and the largest logit difference seen over all steps.

Roofline
--------
Copy bandwidth: a 1 GiB device-to-device ``dst.copy_(src)`` timed with CUDA events, median of 10,
counted as (bytes read + bytes written) / time. Bytes per decode step at batch B: every weight read
once (each layer's qkv, o, gate_up, down and its norms, the final norm, the LM head; the embedding
only B rows, nothing extra when tied to the LM head, which is counted once) plus the KV cache read
by attention, B x 512 x layers x 2 x KV heads x head_dim x 2 bytes. Roofline tok/s = B / (bytes per
step / bandwidth); each path's % = its tok/s / roofline tok/s. (dense-1B at batch 1: 2.49 GB.) The
timed steps actually attend over 513..512+steps tokens; the roofline counts 512.

Run time and the budget
-----------------------
Everything runs in one process, in three phases: (1) hf, eager and graph for every shape and batch;
(2) torch.compile, batch 1 of every shape first, then the largest batch, then the rest, each job
started only if its estimated time (20 s + 2.5 s per layer, then 1.15x the shape's last job) plus
30 s per shape reserved for the megakernel still ends within ``--budget`` (a job that does not fit
is recorded as ``skipped`` with the reason); (3) the megakernel, last so that a hang or a crash there
loses nothing measured before it. Both shapes' weights stay on the GPU until their last phase
(about 50 GB at most, with the megakernel's packed copy of dense-8B). A watchdog thread saves the
JSON, prints the table and exits at ``--deadline``. Expect phase 1 to take 2-4 minutes on an H100;
each torch.compile job takes roughly 1 minute (dense-1B) to 2 minutes (dense-8B), so with the
default budget not every batch gets one: run the rest separately, e.g. ``--paths compile
--compile-batches 4``.

``--tiny``: shape ``tiny``, float32 on the CPU, context 24, block size 4, Triton's interpreter
(``TRITON_INTERPRET=1``), the graph path uncaptured, torch.compile only if ``--paths`` names it.
Timings there mean nothing; it checks the plumbing and the token equality.

Output: a table on stdout (progress on stderr) and the JSON, rewritten after every path so that a
run cut short keeps what it measured: GPU name and driver, torch/triton/transformers/CUDA versions,
git commit, command line, date, copy bandwidth, per shape and batch the roofline and per path every
run's step time, the median, tok/s, % of roofline, bytes per step, the tokens and the checks.
"""
from __future__ import annotations

import os
import sys

import torch

if "--tiny" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from slipstream.models.llama import LlamaModel  # noqa: E402
from slipstream.step import ContiguousSlots, StepBuilder, decode_step  # noqa: E402
from slipstream.weights.layers import LlamaLayer  # noqa: E402
from slipstream.models.random_init import shape_config  # noqa: E402
from slipstream.weights.quant import Linear  # noqa: E402

ALL_PATHS = ("hf", "compile", "eager", "graph", "megakernel")
T_START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T_START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def err_str(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# -- environment ----------------------------------------------------------------------------------
def _run_cmd(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15, cwd=REPO)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:
        return None


def gpu_info(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"name": "cpu", "short_name": "cpu", "driver_version": None, "platform": platform.processor()}
    p = torch.cuda.get_device_properties(device)
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", p.name)
    short = m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", p.name.lower()).strip("-")
    drv = _run_cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {"name": p.name, "short_name": short, "driver_version": drv.splitlines()[0].strip() if drv else None,
            "sm_count": p.multi_processor_count, "total_memory_bytes": p.total_memory,
            "capability": f"{p.major}.{p.minor}"}


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda}
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:
            out[mod] = f"unavailable: {err_str(e)}"
    return out


def git_commit() -> tuple[str | None, bool | None]:
    head = _run_cmd(["git", "rev-parse", "HEAD"])
    status = _run_cmd(["git", "status", "--porcelain", "--untracked-files=no"]) if head else None
    return head, (bool(status) if status is not None else None)


# -- timing -----------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loop(fn: Callable[[], None], n: int, device: torch.device) -> float:
    """Seconds for n calls of fn: CUDA events around the loop (one sync at the end) on a GPU."""
    sync(device)
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> dict[str, Any]:
    """A large device-to-device copy: (bytes read + bytes written) / median time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [time_loop(lambda: dst.copy_(src), 1, device) for _ in range(reps)]
    med = statistics.median(times)
    return {"bytes_copied": nbytes, "bytes_moved_per_copy": 2 * nbytes, "times_s": times,
            "median_s": med, "bytes_per_s": 2 * nbytes / med, "GB_per_s": 2 * nbytes / med / 1e9}


# -- models -------------------------------------------------------------------------------------------
def hf_accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def build_models(shape: str, dtype: torch.dtype, device: torch.device, seed: int):
    """(cfg, HF LlamaForCausalLM, Slipstream LlamaModel, info) on the same tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = shape_config(shape)
    hcfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=False, mlp_bias=False)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)    # random init directly in bf16 on the GPU: no 8B float32 CPU init
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(hcfg)
    finally:
        torch.set_default_dtype(prev)
    hf.eval().requires_grad_(False)
    emb = hf.model.embed_tokens.weight
    if cfg.tie_word_embeddings and hf.lm_head.weight is not emb:
        hf.lm_head.weight = emb
    W = lambda p: p.detach()  # noqa: E731   shares storage with the HF parameter
    V, Hd = cfg.vocab_size, cfg.hidden_size
    embed = Linear(V, Hd, W(emb))
    weights: dict[str, Any] = {"embed": embed, "norm": W(hf.model.norm.weight).float(),
                               "lm_head": embed if cfg.tie_word_embeddings else Linear(V, Hd, W(hf.lm_head.weight))}
    for i, layer in enumerate(hf.model.layers):
        a, m = layer.self_attn, layer.mlp
        qkv = torch.cat([W(a.q_proj.weight), W(a.k_proj.weight), W(a.v_proj.weight)]).contiguous()
        gu = torch.cat([W(m.gate_proj.weight), W(m.up_proj.weight)]).contiguous()
        weights[f"layers.{i}"] = LlamaLayer(
            attn_norm=W(layer.input_layernorm.weight).float(),
            ffn_norm=W(layer.post_attention_layernorm.weight).float(),
            qkv=Linear(qkv.shape[0], Hd, qkv), o=Linear(Hd, a.o_proj.weight.shape[1], W(a.o_proj.weight)),
            gate_up=Linear(gu.shape[0], Hd, gu),
            down=Linear(Hd, m.down_proj.weight.shape[1], W(m.down_proj.weight)))
    model = LlamaModel(cfg, weights)
    model.device = device
    model.kv_dtype = dtype
    model.inv_freq = model.inv_freq.to(device)
    info: dict[str, Any] = {"hf_attn_implementation": getattr(hf.config, "_attn_implementation", None),
                            "hf_param_dtype": str(emb.dtype), "tied": hf.lm_head.weight is emb,
                            "hf_takes_cache_position": hf_accepts(hf.model.forward, "cache_position")}
    try:   # the rotary tables must agree, or HF and Slipstream run different models
        hinv = hf.model.rotary_emb.inv_freq.float().to(device)
        info["rope_inv_freq_max_abs_diff"] = float((hinv - model.inv_freq.float()).abs().max())
    except Exception as e:
        info["rope_inv_freq_max_abs_diff"] = f"unchecked: {err_str(e)}"
    return cfg, hf, model, info


def step_bytes(model: LlamaModel, batch: int, context: int) -> dict[str, int]:
    """Bytes a decode step of `batch` sequences at `context` must read: weights + KV."""
    seen: set[int] = set()

    def nb(w) -> int:
        if w is None or id(w) in seen:
            return 0
        seen.add(id(w))
        return w.nbytes if isinstance(w, Linear) else w.numel() * w.element_size()

    weights = 0
    for L in model.layers:
        weights += sum(nb(getattr(L, k)) for k in L.LINEARS + L.VECTORS)
    weights += nb(model.norm) + nb(model.lm_head)
    embed = 0 if model.embed is model.lm_head else model.embed.nbytes // model.embed.n * batch
    kv = batch * context * model.kv_bytes_per_token()
    return {"weight_bytes": weights, "embed_row_bytes": embed, "kv_bytes": kv, "bytes_per_step": weights + embed + kv}


# -- paths: reset() / step() / last_tokens() / logits() -----------------------------------------------
class Layout:
    """Contiguous blocks: sequence b owns blocks [b*W, (b+1)*W)."""

    def __init__(self, context: int, steps: int, block_size: int, max_batch: int):
        self.context, self.bs, self.max_batch = context, block_size, max_batch
        self.W = -(-(context + steps + 1) // block_size)
        self.per_seq = self.W * block_size

    def base(self, b: int) -> int:
        return b * self.per_seq


class EagerPath:
    name = "eager"

    def __init__(self, model: LlamaModel, kv, layout: Layout, B: int, t0: torch.Tensor):
        self.model, self.kv, self.L, self.B, self.t0 = model, kv, layout, B, t0
        dev = model.device
        self.dev = dev

    def reset(self) -> None:
        c, L = self.L.context, self.L
        self.tok = self.t0[:self.B].clone()
        self.cur = decode_step([ContiguousSlots(L.base(b)) for b in range(self.B)], self.tok.tolist(),
                               [c] * self.B).to(self.dev)
        self._logits = None

    def step(self) -> None:
        logits = self.model.forward(self.cur, self.kv)
        self.tok = logits.argmax(-1)
        self.cur = self.cur.next_decode(self.tok)    # on the device: no host sync between steps
        self._logits = logits

    def last_tokens(self) -> torch.Tensor:
        return self.tok

    def logits(self) -> torch.Tensor | None:
        return self._logits


class _Reserved(ContiguousSlots):
    """A sequence's whole reserved slot range as its read: `fill` builds the block table from it."""

    def __init__(self, base: int, size: int):
        super().__init__(base)
        self.size = size

    def read_slots(self, end: int) -> tuple[int, int]:
        return (self.base, self.base + self.size)

    def read_ids(self, end: int) -> tuple[int, int]:
        return self.read_slots(end)


class StaticPath:
    """GraphDecoder / MegakernelDecoder: static(B), fill(s, step), replay(s), device-side feedback."""

    def __init__(self, name: str, dec, layout: Layout, B: int, t0: torch.Tensor):
        self.name, self.dec, self.L, self.B, self.t0 = name, dec, layout, B, t0
        self.s = dec.static(B)         # captures the CUDA graph (on a GPU)
        c, L = layout.context, layout
        # each sequence's read range is its whole reserved slot range: `fill` builds the block table
        # from it (so the table already holds the blocks the context grows into on the device) and
        # takes the attention length from `context` (c + 1)
        self.step0 = decode_step([_Reserved(L.base(b), L.per_seq) for b in range(B)], t0[:B].tolist(), [c] * B)
        s = self.s
        self.v_tok, self.v_next = s.tokens[:B], s.next_tokens[:B]
        self.v_pos, self.v_slots, self.v_ctx = s.positions[:B], s.slots[:B], s.context[:B]

    def reset(self) -> None:
        self.dec.fill(self.s, self.step0)

    def step(self) -> None:
        self.dec.replay(self.s)
        self.v_tok.copy_(self.v_next)
        self.v_pos.add_(1)
        self.v_slots.add_(1)
        self.v_ctx.add_(1)

    def force_tokens(self, tok: torch.Tensor) -> None:
        self.v_tok.copy_(tok.to(self.v_tok.dtype))

    def check(self) -> None:
        """Raises if the steps since the last check failed on the device (the megakernel's error
        word: a wait that timed out drains the kernel instead of hanging). A host synchronisation."""
        if self.name == "megakernel":
            from slipstream.runtime.megakernel import check
            check(self.s)

    def last_tokens(self) -> torch.Tensor:
        return self.v_next

    def logits(self) -> torch.Tensor | None:
        lg = getattr(self.s, "logits", None)
        return lg[:self.B] if isinstance(lg, torch.Tensor) else None


def make_static_cache(config, max_len: int, batch: int, device: torch.device, dtype: torch.dtype):
    from transformers import StaticCache
    try:
        return StaticCache(config=config, max_cache_len=max_len)          # transformers 5.x
    except TypeError:
        return StaticCache(config=config, max_batch_size=batch, max_cache_len=max_len,   # 4.x
                           device=device, dtype=dtype)


class HFPath:
    def __init__(self, name: str, hf, fn: Callable, prompts: torch.Tensor, B: int, context: int,
                 max_len: int, t0: torch.Tensor, dtype: torch.dtype, compiled: bool):
        self.name, self.hf, self.fn, self.B, self.c, self.t0 = name, hf, fn, B, context, t0
        self.compiled = compiled
        dev = t0.device
        self.use_cp = hf_accepts(hf.model.forward, "cache_position")
        self.cache = make_static_cache(hf.config, max_len, B, dev, dtype)
        kw: dict[str, Any] = dict(input_ids=prompts[:B].to(dev), past_key_values=self.cache, use_cache=True)
        if self.use_cp:
            kw["cache_position"] = torch.arange(context, device=dev)
        if hf_accepts(hf.forward, "logits_to_keep"):
            kw["logits_to_keep"] = 1
        with torch.no_grad():
            hf(**kw)      # prefill, always eager (HF's recipe: the prefill is not compiled)
        self.tok = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        self.cp = torch.zeros(1, dtype=torch.int64, device=dev)
        self._logits = None
        self._next = None

    def _rewind(self) -> None:
        """Back to `context` cached tokens: transformers versions without cache_position count the
        tokens in each layer's `cumulative_length`."""
        for layer in getattr(self.cache, "layers", []) or []:
            cl = getattr(layer, "cumulative_length", None)
            if isinstance(cl, torch.Tensor):
                cl.fill_(self.c)
            elif isinstance(cl, int):
                layer.cumulative_length = self.c

    def reset(self) -> None:
        self._rewind()
        self.tok.copy_(self.t0[:self.B, None])
        self.pos.fill_(self.c)
        self.cp.fill_(self.c)

    def step(self) -> None:
        kw: dict[str, Any] = dict(input_ids=self.tok, position_ids=self.pos, past_key_values=self.cache, use_cache=True)
        if self.use_cp:
            kw["cache_position"] = self.cp
        with torch.no_grad():
            if self.compiled and hasattr(torch, "compiler") and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
                torch.compiler.cudagraph_mark_step_begin()
            out = self.fn(**kw)
            logits = out.logits[:, -1, :]
            nxt = logits.argmax(-1)
            self.tok.copy_(nxt[:, None])
            self.pos.add_(1)
            self.cp.add_(1)
        self._logits, self._next = logits, nxt

    def last_tokens(self) -> torch.Tensor:
        return self._next

    def logits(self) -> torch.Tensor | None:
        return self._logits


# -- measuring ---------------------------------------------------------------------------------------
def measure(path, B: int, steps: int, warmup: int, runs: int, device: torch.device, rec: dict) -> torch.Tensor:
    """Check run (tokens, first-step logits), warm-up, timed runs. Returns the first-step logits.
    A path with a device-side error check (`path.check`, the megakernel's) is checked after the check
    run, after the warm-up and after every timed run (outside its timing): a run whose kernel timed
    out raises instead of being reported; `checked_runs` counts the timed runs so checked."""
    check = getattr(path, "check", None)
    path.reset()
    toks, first = [], None
    for i in range(steps):
        path.step()
        if i == 0:
            lg = path.logits()
            first = None if lg is None else lg[:B].detach().float().cpu().clone()   # the buffer is reused
        toks.append(path.last_tokens()[:B].clone())
    tokens = torch.stack(toks).cpu()
    rec["tokens"] = tokens.tolist()
    if check:
        check()
    path.reset()
    for _ in range(warmup):
        path.step()
    sync(device)
    if check:
        check()
    times, repeat = [], []
    for _ in range(runs):
        path.reset()
        times.append(time_loop(path.step, steps, device) / steps)
        if check:
            check()
            rec["checked_runs"] = len(times)
        repeat.append(path.last_tokens()[:B].cpu().tolist() == tokens[-1].tolist())
    med = statistics.median(times)
    rec.update(status="ok", step_times_s=times, median_step_s=med, tok_s=B / med, repeatable=all(repeat),
               steps=steps, warmup=warmup, runs=runs)
    return first


def free_running(a: list, b: list) -> dict[str, Any]:
    n = min(len(a), len(b))
    k = next((i for i in range(n) if a[i] != b[i]), n)
    return {"steps": n, "matching_steps": k, "all_match": k == n and len(a) == len(b)}


def logit_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> dict[str, Any]:
    if a is None or b is None:
        return {"max_abs_logit_diff": None}
    return {"max_abs_logit_diff": float((a.float() - b.float()).abs().max()),
            "max_abs_logit": float(a.float().abs().max())}


def lockstep(eager: EagerPath, other: StaticPath, B: int, steps: int) -> dict[str, Any]:
    """Both from the same state, `other` fed eager's token every step: argmax disagreements and
    the largest logit difference over all steps (24 steps cross the first block boundary)."""
    eager.reset()
    other.reset()
    mism, maxdiff, scale = 0, 0.0, 0.0
    for _ in range(steps):
        eager.step()
        other.step()
        te, to = eager.last_tokens()[:B], other.last_tokens()[:B]
        mism += int((te != to.to(te.dtype)).sum())
        le, lo = eager.logits(), other.logits()
        if lo is not None:
            maxdiff = max(maxdiff, float((le[:B].float() - lo[:B].float()).abs().max()))
            scale = max(scale, float(le[:B].float().abs().max()))
        other.force_tokens(te)
    return {"steps": steps, "token_mismatches": mism, "rows": B,
            "max_abs_logit_diff": maxdiff if other.logits() is not None else None, "max_abs_logit": scale}


# -- the run -----------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
        self.dtype = torch.float32 if args.tiny else torch.bfloat16
        self.lock = threading.RLock()
        self.state: dict[str, dict] = {}          # per shape: models, KV, prompts, t0
        self.first: dict[tuple, torch.Tensor | None] = {}
        self.current = "start"
        commit, dirty = git_commit()
        now = datetime.datetime.now(datetime.timezone.utc)
        self.gpu = gpu_info(self.device)
        self.out = Path(args.out) if args.out else \
            REPO / "benchmarks" / "results" / f"gpu_decode_{now:%Y-%m-%d}_{self.gpu['short_name']}.json"
        self.doc: dict[str, Any] = {
            "benchmark": "gpu_decode", "date": now.isoformat(timespec="seconds"),
            "command": shlex.join(["python", *sys.argv]), "argv": sys.argv, "cwd": os.getcwd(),
            "gpu": self.gpu, "versions": versions(), "commit": commit, "commit_dirty": dirty,
            "settings": {"shapes": args.shapes, "batches": args.batches, "paths": args.paths,
                         "compile_batches": args.compile_batches, "context": args.context, "steps": args.steps,
                         "warmup": args.warmup, "runs": args.runs, "block_size": args.block_size,
                         "dtype": str(self.dtype), "device": str(self.device), "seed": args.seed, "tune": args.tune,
                         "budget_s": args.budget, "deadline_s": args.deadline,
                         "triton_interpret": os.environ.get("TRITON_INTERPRET")},
            "bandwidth": None, "shapes": {}, "kernel_configs": {}, "results": [], "errors": [],
            "status": "running", "elapsed_s": None}
        self.entries: dict[tuple[str, int], dict] = {}

    # -- bookkeeping --
    def save(self) -> None:
        with self.lock:
            self.doc["elapsed_s"] = round(time.monotonic() - T_START, 2)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(json.dumps(self.doc, indent=1, default=str))
            os.replace(tmp, self.out)

    def entry(self, shape: str, B: int) -> dict:
        key = (shape, B)
        if key not in self.entries:
            e = {"shape": shape, "batch": B, "context": self.a.context, "roofline": None,
                 "paths": {}, "checks": {}}
            self.entries[key] = e
            self.doc["results"].append(e)
        return self.entries[key]

    def guarded(self, what: str, fn: Callable[[], Any], rec: dict | None = None) -> Any:
        self.current = what
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as e:
            log(f"{what}: FAILED {err_str(e)}")
            target = rec if rec is not None else {}
            target.update(status="error", error=err_str(e), traceback=traceback.format_exc(limit=8))
            if rec is None:
                self.doc["errors"].append({"where": what, "error": err_str(e),
                                           "traceback": traceback.format_exc(limit=8)})
            if "out of memory" in str(e).lower() and self.device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
            return None
        finally:
            if rec is not None:
                rec["wall_s"] = round(time.monotonic() - t0, 2)
            self.save()

    # -- shapes --
    def shape_state(self, shape: str) -> dict:
        if shape in self.state:
            return self.state[shape]
        log(f"{shape}: building random {self.dtype} weights")
        t0 = time.monotonic()
        try:
            built = build_models(shape, self.dtype, self.device, self.a.seed)
        except torch.OutOfMemoryError:
            for other in list(self.state):
                self.free(other)
            built = build_models(shape, self.dtype, self.device, self.a.seed)
        cfg, hf, model, info = built
        layout = Layout(self.a.context, max(self.a.steps, self.a.warmup, 3), self.a.block_size, max(self.a.batches))
        g = torch.Generator().manual_seed(self.a.seed + 1)
        prompts = torch.randint(0, cfg.vocab_size, (layout.max_batch, self.a.context), generator=g)
        kv = model.new_kv_cache(layout.max_batch * layout.W, layout.bs)
        t0_tokens = self.prefill(model, kv, layout, prompts)
        st = {"cfg": cfg, "hf": hf, "model": model, "layout": layout, "prompts": prompts, "kv": kv,
              "t0": t0_tokens, "decoders": {}, "configs": None}
        info.update(build_s=round(time.monotonic() - t0, 2), layers=cfg.num_layers, hidden=cfg.hidden_size,
                    heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    ffn=cfg.intermediate_size, vocab=cfg.vocab_size, rope_theta=cfg.rope_theta,
                    kv_bytes_per_token=model.kv_bytes_per_token(), blocks_per_seq=layout.W,
                    first_tokens=t0_tokens.tolist())
        self.doc["shapes"][shape] = info
        self.state[shape] = st
        if self.a.tune:
            self.guarded(f"{shape}/tune", lambda: self.tune(shape, st))
        log(f"{shape}: built in {info['build_s']} s")
        return st

    def tune(self, shape: str, st: dict) -> None:
        from slipstream.kernels.triton.configs import decode_shapes, tune_matvec
        t0 = time.monotonic()
        st["configs"] = tune_matvec(decode_shapes(st["cfg"], self.a.batches), dtype=self.dtype,
                                    device=str(self.device))
        self.doc["kernel_configs"][shape] = {"tune_s": round(time.monotonic() - t0, 1),
                                             "configs": json.loads(st["configs"].to_json())}

    def prefill(self, model: LlamaModel, kv, L: Layout, prompts: torch.Tensor) -> torch.Tensor:
        """All max_batch prompts in one eager step; returns each sequence's first decode token."""
        n, c = prompts.shape
        b = StepBuilder()
        for i in range(n):
            b.add(ContiguousSlots(L.base(i)), prompts[i].tolist(), 0)
        logits = model.forward(b.build(), kv)
        return logits.argmax(-1).to(model.device)

    def clone_kv(self, st: dict):
        kv = st["kv"]
        new = st["model"].new_kv_cache(kv.num_blocks, kv.block_size)
        new.k.copy_(kv.k)
        new.v.copy_(kv.v)
        return new

    def free_slipstream(self, shape: str) -> None:
        st = self.state.get(shape)
        if st:
            for k in ("model", "kv", "decoders"):
                st.pop(k, None)
            self._empty()

    def free(self, shape: str) -> None:
        self.state.pop(shape, None)
        self._empty()

    def _empty(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- paths --
    def roofline(self, shape: str, B: int) -> None:
        st = self.shape_state(shape)
        e = self.entry(shape, B)
        r = step_bytes(st["model"], B, self.a.context)
        bw = (self.doc["bandwidth"] or {}).get("bytes_per_s")
        r["bandwidth_bytes_per_s"] = bw
        r["step_s"] = r["bytes_per_step"] / bw if bw else None
        r["tok_s"] = B * bw / r["bytes_per_step"] if bw else None
        e["roofline"] = r

    def finish(self, shape: str, B: int, name: str, rec: dict) -> None:
        e = self.entry(shape, B)
        roof = e.get("roofline") or {}
        if rec.get("status") == "ok":
            rec["bytes_per_step"] = roof.get("bytes_per_step")
            rec["pct_roofline"] = 100.0 * rec["tok_s"] / roof["tok_s"] if roof.get("tok_s") else None
            pct = f"{rec['pct_roofline']:.1f}%" if rec["pct_roofline"] is not None else "-"
            log(f"{shape} B={B} {name}: {rec['tok_s']:.1f} tok/s ({pct} of roofline), "
                f"step {1e3 * rec['median_step_s']:.3f} ms")

    def finish_all(self, why: str) -> None:
        """At the deadline: % of roofline for paths measured but not yet reported, and the path that
        was running marked as cut off."""
        for (shape, B), e in list(self.entries.items()):
            for name, rec in list(e["paths"].items()):
                if rec.get("status") == "running":
                    rec.update(status="error", error=why)
                elif rec.get("status") == "ok" and "pct_roofline" not in rec:
                    self.finish(shape, B, name, rec)

    def run_path(self, shape: str, B: int, name: str) -> None:
        e = self.entry(shape, B)
        rec: dict[str, Any] = {"status": "running"}
        e["paths"][name] = rec
        fn = {"hf": self._hf, "eager": self._eager, "graph": self._static, "megakernel": self._static,
              "compile": self._compile}[name]
        self.guarded(f"{shape}/B={B}/{name}", lambda: fn(shape, B, name, rec), rec)
        if rec.get("status") == "running":
            rec["status"] = "error"
        self.finish(shape, B, name, rec)
        self.checks(shape, B)
        self.save()

    def _hf_len(self) -> int:
        return self.a.context + max(self.a.steps, self.a.warmup, 3) + 1

    def _hf(self, shape: str, B: int, name: str, rec: dict) -> None:
        st = self.shape_state(shape)
        t0 = time.monotonic()
        p = HFPath("hf", st["hf"], st["hf"], st["prompts"], B, self.a.context, self._hf_len(), st["t0"],
                   self.dtype, compiled=False)
        rec["setup_s"] = round(time.monotonic() - t0, 2)
        rec["cache_position_api"] = p.use_cp
        self.first[(shape, B, name)] = measure(p, B, self.a.steps, self.a.warmup, self.a.runs, self.device, rec)

    def _eager(self, shape: str, B: int, name: str, rec: dict) -> None:
        st = self.shape_state(shape)
        p = EagerPath(st["model"], st["kv"], st["layout"], B, st["t0"])
        self.first[(shape, B, name)] = measure(p, B, self.a.steps, self.a.warmup, self.a.runs, self.device, rec)

    def _decoder(self, shape: str, name: str):
        st = self.shape_state(shape)
        if name not in st["decoders"]:
            L = st["layout"]
            if name == "graph":
                from slipstream.runtime.graph import GraphDecoder
                st["decoders"][name] = GraphDecoder(st["model"], self.clone_kv(st), max_batch=L.max_batch,
                                                    max_context=L.per_seq, configs=st["configs"])
            else:
                try:
                    from slipstream.runtime.megakernel import MegakernelDecoder
                except Exception as e:
                    raise RuntimeError(f"unavailable: {err_str(e)}") from e
                st["decoders"][name] = MegakernelDecoder(
                    st["model"], self.clone_kv(st), max_batch=L.max_batch, max_context=L.per_seq,
                    num_warps=self.a.mk_num_warps, programs_per_sm=self.a.mk_programs_per_sm,
                    block_k=self.a.mk_block_k, prefetch=self.a.mk_prefetch)
        return st["decoders"][name]

    def _static(self, shape: str, B: int, name: str, rec: dict) -> None:
        st = self.shape_state(shape)
        t0 = time.monotonic()
        try:
            dec = self._decoder(shape, name)
        except RuntimeError as e:
            if str(e).startswith("unavailable"):
                rec.update(status="unavailable", error=str(e))
                return
            raise
        p = StaticPath(name, dec, st["layout"], B, st["t0"])
        sync(self.device)
        rec["setup_s"] = round(time.monotonic() - t0, 2)     # construction + capture of this bucket
        if name == "graph":
            rec["captured"] = getattr(p.s, "graph", None) is not None
        rec["bucket"] = getattr(p.s, "batch", None)
        self.first[(shape, B, name)] = measure(p, B, self.a.steps, self.a.warmup, self.a.runs, self.device, rec)
        if name == "megakernel":   # (`measure` checked the error word after every run)
            from slipstream.runtime.megakernel import check, profile_summary
            rec["programs"], rec["num_warps"], rec["prefetch"] = dec.num_programs, dec.num_warps, dec.prefetch
            rec["tasks"] = p.s.plan.num_tasks
            if self.device.type == "cuda":   # one more step with the kernel's own per-task timestamps
                prof = torch.zeros(p.s.plan.num_tasks, 3, dtype=torch.int64, device=self.device)
                p.reset()
                dec.replay(p.s, profile=prof)
                sync(self.device)
                check(p.s)
                rec["profile"] = profile_summary(p.s.plan, prof)
        e = self.entry(shape, B)
        try:
            eager = EagerPath(st["model"], st["kv"], st["layout"], B, st["t0"])
            e["checks"].setdefault(f"{name}_vs_eager", {})["forced"] = lockstep(eager, p, B, min(self.a.steps, 24))
        except Exception as ex:
            e["checks"].setdefault(f"{name}_vs_eager", {})["forced"] = {"error": err_str(ex)}

    def _compile(self, shape: str, B: int, name: str, rec: dict) -> None:
        st = self.shape_state(shape)
        hf = st["hf"]
        dyn = getattr(torch, "_dynamo", None)
        for attr in ("recompile_limit", "cache_size_limit"):
            if dyn is not None and hasattr(dyn.config, attr):
                setattr(dyn.config, attr, max(64, getattr(dyn.config, attr)))
        t0 = time.monotonic()
        errors = []
        p = None
        for fullgraph in (True, False):
            try:
                torch._dynamo.reset()
                try:
                    torch._dynamo.utils.counters.clear()
                except Exception:
                    pass
                fn = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=fullgraph)
                p = HFPath("compile", hf, fn, st["prompts"], B, self.a.context, self._hf_len(), st["t0"],
                           self.dtype, compiled=True)
                p.reset()
                for _ in range(3):          # compile, cudagraph warm-up, recording
                    p.step()
                sync(self.device)
                rec["fullgraph"] = fullgraph
                break
            except Exception as e:
                errors.append(f"fullgraph={fullgraph}: {err_str(e)}")
                log(f"{shape} B={B} compile fullgraph={fullgraph} failed: {err_str(e)}")
                p = None
        if errors:
            rec["compile_errors"] = errors
        if p is None:
            raise RuntimeError("; ".join(errors))
        rec["setup_s"] = round(time.monotonic() - t0, 2)
        rec["cache_position_api"] = p.use_cp
        try:
            self.first[(shape, B, name)] = measure(p, B, self.a.steps, self.a.warmup, self.a.runs, self.device, rec)
            try:   # graphs compiled and graph breaks: more than one graph here means recompiles
                from torch._dynamo.utils import counters
                rec["dynamo_counters"] = {k: dict(v) for k, v in counters.items()
                                          if k in ("stats", "graph_break", "recompiles", "inductor")}
            except Exception:
                pass
        finally:
            del p
            for reset in ("torch._dynamo.reset", "torch._inductor.cudagraph_trees.reset_cudagraph_trees"):
                try:   # drop the compiled code and its CUDA-graph memory pool before the next batch
                    mod, fn = reset.rsplit(".", 1)
                    getattr(sys.modules.get(mod) or __import__(mod, fromlist=[fn]), fn)()
                except Exception:
                    pass
            self._empty()

    def checks(self, shape: str, B: int) -> None:
        e = self.entry(shape, B)
        P = e["paths"]
        for a, b in (("graph", "eager"), ("megakernel", "eager"), ("compile", "hf"), ("hf", "eager")):
            if P.get(a, {}).get("status") != "ok" or P.get(b, {}).get("status") != "ok":
                continue
            c = e["checks"].setdefault(f"{a}_vs_{b}", {})
            c["free_running"] = free_running(P[a]["tokens"], P[b]["tokens"])
            c["first_step"] = logit_diff(self.first.get((shape, B, b)), self.first.get((shape, B, a)))

    # -- the schedule --
    def run(self) -> None:
        a = self.a
        self.current = "bandwidth"
        nbytes = (16 << 20) if a.tiny else (1 << 30)
        self.doc["bandwidth"] = self.guarded("bandwidth", lambda: copy_bandwidth(self.device, nbytes))
        paths = a.paths
        # phase 1: hf, eager, graph (every shape); phase 2: torch.compile within the budget; phase 3:
        # the megakernel last, so that a hang or a crash there costs nothing measured before it
        for shape in a.shapes:
            if self.guarded(f"{shape}/build", lambda: self.shape_state(shape)) is None:
                continue
            for B in a.batches:
                self.guarded(f"{shape}/B={B}/roofline", lambda: self.roofline(shape, B))
                for name in ("hf", "eager", "graph"):
                    if name in paths:
                        self.run_path(shape, B, name)
            if "megakernel" not in paths:
                self.free_slipstream(shape)
            if "compile" not in paths and "megakernel" not in paths:
                self.free(shape)
        if "compile" in paths:
            order = sorted(a.compile_batches, key=lambda b: (b != 1, b != max(a.compile_batches), b))
            spent: dict[str, float] = {}
            for B in order:
                for shape in a.shapes:
                    if shape not in self.state:
                        continue
                    cfg = self.state[shape]["cfg"]
                    est = spent.get(shape, 20 + 2.5 * cfg.num_layers)
                    reserve = 30 * len(a.shapes) if "megakernel" in paths else 0
                    left = a.budget - (time.monotonic() - T_START)
                    if est + reserve > left:
                        rec = {"status": "skipped",
                               "reason": f"time budget: ~{est:.0f} s needed (+{reserve} s reserved), "
                                         f"{left:.0f} s left of --budget {a.budget}"}
                        self.entry(shape, B)["paths"]["compile"] = rec
                        log(f"{shape} B={B} compile: skipped ({rec['reason']})")
                        self.save()
                        continue
                    t0 = time.monotonic()
                    self.run_path(shape, B, "compile")
                    spent[shape] = 1.15 * (time.monotonic() - t0)
            for shape in a.shapes:
                if "megakernel" not in paths:
                    self.free(shape)
        if "megakernel" in paths:
            for shape in a.shapes:
                if shape not in self.state or "model" not in self.state[shape]:
                    continue
                for B in a.batches:
                    self.run_path(shape, B, "megakernel")
                self.free(shape)
        self.doc["status"] = "done"
        self.current = "done"
        self.save()


# -- report -----------------------------------------------------------------------------------------
def table(doc: dict) -> str:
    paths = [p for p in ALL_PATHS if p in doc["settings"]["paths"]]
    head = ["shape", "B", "roofline"] + [f"{p} tok/s (%)" for p in paths] + ["graph/compile", "graph=eager", "mk=eager"]
    rows = [head]
    for e in doc["results"]:
        roof = e.get("roofline") or {}
        row = [e["shape"], str(e["batch"]), f"{roof['tok_s']:.0f}" if roof.get("tok_s") else "-"]
        for p in paths:
            r = e["paths"].get(p, {})
            st = r.get("status")
            if st == "ok":
                pct = f" ({r['pct_roofline']:.1f}%)" if r.get("pct_roofline") is not None else ""
                row.append(f"{r['tok_s']:.1f}{pct}")
            else:
                row.append(st or "-")
        g, c = e["paths"].get("graph", {}), e["paths"].get("compile", {})
        row.append(f"{g['tok_s'] / c['tok_s']:.2f}x" if g.get("status") == c.get("status") == "ok" else "-")
        for k in ("graph_vs_eager", "megakernel_vs_eager"):
            ch = e["checks"].get(k, {})
            fr, fo, fs = ch.get("free_running"), ch.get("forced"), ch.get("first_step")
            if not fr:
                row.append("-")
                continue
            s = f"{fr['matching_steps']}/{fr['steps']}"
            if fs and fs.get("max_abs_logit_diff") is not None:
                s += f" d0={fs['max_abs_logit_diff']:.2g}"
            if fo and "token_mismatches" in fo:
                s += f" forced-mism={fo['token_mismatches']}"
            row.append(s)
        rows.append(row)
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    bw = doc.get("bandwidth") or {}
    pre = [f"GPU: {doc['gpu'].get('name')}  driver {doc['gpu'].get('driver_version')}  "
           f"torch {doc['versions'].get('torch')}  triton {doc['versions'].get('triton')}  "
           f"transformers {doc['versions'].get('transformers')}  commit {str(doc.get('commit'))[:12]}",
           f"copy bandwidth: {bw.get('GB_per_s', float('nan')):.1f} GB/s (read + write);  context "
           f"{doc['settings']['context']}, {doc['settings']['steps']} steps x {doc['settings']['runs']} runs, "
           f"median step;  graph=eager: free-running matching steps, d0 = first-step max |logit diff|"]
    return "\n".join(pre + lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    strs = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    ap.add_argument("--shapes", type=strs, default=None, help="comma list (default dense-1B,dense-8B)")
    ap.add_argument("--batches", type=ints, default=[1, 4, 8])
    ap.add_argument("--paths", type=strs, default=None, help=f"comma list of {','.join(ALL_PATHS)}")
    ap.add_argument("--compile-batches", type=ints, default=None, help="batches that get torch.compile")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per sequence (512)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per run")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tune", action="store_true", help="tune the matvec tiles for the graph path first")
    ap.add_argument("--mk-num-warps", type=int, default=8, help="megakernel: warps per program")
    ap.add_argument("--mk-programs-per-sm", type=int, default=1, help="megakernel: persistent programs per SM")
    ap.add_argument("--mk-block-k", type=int, default=None, help="megakernel: K-chunk of its matvec tiles")
    ap.add_argument("--mk-prefetch", type=int, default=0, choices=[0, 1],
                    help="megakernel: 1 = a task waiting on its dependency first reads its weights into L2")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds: a torch.compile job starts only if it should end within this")
    ap.add_argument("--deadline", type=float, default=540.0,
                    help="seconds: the watchdog saves the JSON, prints the table and exits")
    ap.add_argument("--out", default=None, help="the JSON (default benchmarks/results/gpu_decode_<date>_<gpu>.json)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: shape tiny, float32, context 24")
    a = ap.parse_args(argv)
    a.shapes = a.shapes or (["tiny"] if a.tiny else ["dense-1B", "dense-8B"])
    a.context = a.context or (24 if a.tiny else 512)
    a.block_size = a.block_size or (4 if a.tiny else 16)
    a.paths = a.paths or [p for p in ALL_PATHS if not (a.tiny and p == "compile")]
    bad = [p for p in a.paths if p not in ALL_PATHS]
    if bad:
        ap.error(f"unknown paths {bad}; choose from {ALL_PATHS}")
    a.batches = sorted(set(a.batches))
    cb = a.compile_batches or list(a.batches)
    a.compile_batches = sorted({b for b in cb if b in a.batches})
    if len(a.compile_batches) != len(set(cb)):
        ap.error("--compile-batches must be a subset of --batches")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    bench = Bench(args)
    log(f"device {bench.device} ({bench.gpu.get('name')}), writing {bench.out}")

    def watchdog() -> None:
        time.sleep(max(1.0, args.deadline - (time.monotonic() - T_START)))
        with bench.lock:
            try:
                bench.doc["status"] = f"killed by the watchdog at --deadline {args.deadline} s during {bench.current}"
                bench.doc["errors"].append({"where": bench.current, "error": "deadline reached"})
                bench.finish_all(f"cut off by the watchdog at --deadline {args.deadline} s")
                for _ in range(3):   # the main thread may be changing the document meanwhile
                    try:
                        bench.save()
                        break
                    except Exception:
                        time.sleep(0.2)
                print(table(bench.doc), flush=True)
            finally:
                log(f"deadline reached during {bench.current}; results in {bench.out}")
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        bench.run()
    except Exception as e:   # the schedule itself failed: keep whatever was measured
        bench.doc["errors"].append({"where": bench.current, "error": err_str(e), "traceback": traceback.format_exc()})
        bench.doc["status"] = "failed"
        bench.save()
    with bench.lock:
        print(table(bench.doc), flush=True)
        print(f"\nJSON: {bench.out}", flush=True)
    return 0 if bench.doc["status"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
