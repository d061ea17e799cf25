"""The persistent megakernel (under Triton's interpreter on a CPU) against the torch plan executor
and the eager step on a tiny random model; a lost signal ends in the error word, not a hang; and
the kernel compiles for Hopper (sm_90) with Triton's offline compiler, which the interpreter
cannot check (types must agree across branches, loop-carried values, ...)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from support import decode_step, prefill_step  # noqa: E402

from slipstream.kv.blocks import SequenceKV  # noqa: E402
from slipstream.models.random_init import random_llama, shape_config  # noqa: E402
from slipstream.runtime.megakernel import MegakernelDecoder, MegakernelError, check, launch  # noqa: E402
from slipstream.runtime.plan import WAIT_COUNT, Op, TileConfig  # noqa: E402
from slipstream.runtime.vm import PlanDecoder  # noqa: E402

BLOCK = 4
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # the kernel's device; eager and the VM stay on the CPU
# small tiles: several attention splits, several tiles per projection, short last tiles, each
# head's QKV product in two tasks (4 of its 8 rotation pairs each)
TILES = TileConfig(embed=48, o=24, gate_up=48, down=16, lm_head=96, partition=8, qkv_parts=2)


def _prefill(model, kv, seq: SequenceKV, prompt: list[int]) -> int:
    return int(model.forward(prefill_step(seq, prompt), kv).argmax())


@pytest.mark.parametrize("prompts,prefetch,block", [
    ([[3, 1, 4, 1, 5, 9, 2]], 0, BLOCK),
    ([[3, 1, 4, 1, 5, 9, 2, 6, 5], [7, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], 0, BLOCK),
    ([[3, 1, 4, 1, 5, 9, 2, 6, 5], [7, 7]], 2, BLOCK),     # every task first reads its weights (L2 prefetch)
    # other KV block sizes under the attention split's 8-token steps: not a power of two (3), and
    # larger than a step (16); BLOCK = 4 puts two blocks in a step
    ([[3, 1, 4, 1, 5, 9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], 0, 3),
    ([[3, 1, 4, 1, 5, 9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]], 0, 16),
])
def test_megakernel_matches_vm_and_eager(prompts, prefetch, block):
    model = random_llama(shape_config("tiny"), seed=11)
    mk_model = random_llama(shape_config("tiny"), seed=11, device=DEV)    # the same weights
    caches = {"eager": model.new_kv_cache(32, block), "vm": model.new_kv_cache(32, block),
              "mk": mk_model.new_kv_cache(32, block)}
    models = {"eager": model, "vm": model, "mk": mk_model}
    vm = PlanDecoder(model, caches["vm"], max_batch=4, max_context=64, tiles=TILES)
    mk = MegakernelDecoder(mk_model, caches["mk"], max_batch=4, max_context=64, tiles=TILES, num_programs=3,
                           prefetch=prefetch)
    # the model's matrices now live in the kernel's flat buffer: one copy of the weights
    assert mk.shares_weights
    assert mk_model.layers[1].down.data.untyped_storage().data_ptr() == mk.W.untyped_storage().data_ptr()
    seqs = {name: [SequenceKV(kv) for _ in prompts] for name, kv in caches.items()}
    seqs["mk"][0].reserve(5)    # another block layout: the megakernel's block tables differ
    tokens = [_prefill(model, caches["eager"], s, p) for s, p in zip(seqs["eager"], prompts)]
    for name in ("vm", "mk"):
        for s, p in zip(seqs[name], prompts):
            _prefill(models[name], caches[name], s, p)
    positions = [len(p) for p in prompts]
    for _ in range(3):    # crosses KV blocks and attention partitions
        le = model.forward(decode_step(seqs["eager"], tokens, positions), caches["eager"])
        lv = vm.forward(decode_step(seqs["vm"], tokens, positions))
        lm = mk.forward(decode_step(seqs["mk"], tokens, positions))
        assert (lm - lv).abs().max().item() < 1e-5
        assert (lm - le).abs().max().item() < 1e-4
        assert lm.argmax(-1).tolist() == le.argmax(-1).tolist()
        s = mk.static(len(prompts))
        assert s.next_tokens[:len(prompts)].cpu().tolist() == le.argmax(-1).tolist()   # the in-kernel ARGMAX
        tokens = le.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    # epoch-numbered counters: after 3 steps every event has received 3 x its per-step count
    s = mk.static(len(prompts))
    assert s.sync[:s.plan.num_events].cpu().tolist() == [3 * c for c in s.plan.event_counts]


def test_long_contexts_merge_many_splits_in_chunks():
    """20+ attention splits: ATTN_REDUCE walks them 16 at a time (a long context must not hold
    every partial in registers)."""
    model = random_llama(shape_config("tiny"), seed=14)
    mk_model = random_llama(shape_config("tiny"), seed=14, device=DEV)
    kv_e, kv_m = model.new_kv_cache(32, BLOCK), mk_model.new_kv_cache(32, BLOCK)
    tiles = TileConfig(embed=64, o=32, gate_up=64, down=32, lm_head=128, partition=2)
    mk = MegakernelDecoder(mk_model, kv_m, max_batch=1, max_context=64, tiles=tiles, num_programs=2)
    assert mk.static(1).plan.splits == 32
    prompt = [(7 * i) % 200 + 1 for i in range(41)]
    se, sm = SequenceKV(kv_e), SequenceKV(kv_m)
    tok = _prefill(model, kv_e, se, prompt)
    _prefill(mk_model, kv_m, sm, prompt)
    le = model.forward(decode_step([se], [tok], [41]), kv_e)
    lm = mk.forward(decode_step([sm], [tok], [41]))
    assert (lm - le).abs().max().item() < 1e-4


@pytest.mark.parametrize("prefetch", [0, 1])   # 1: the waiting O_PROJ task reads its tile chunk by chunk
def test_a_lost_signal_sets_the_error_word_instead_of_hanging(prefetch):
    model = random_llama(shape_config("tiny"), seed=12, device=DEV)
    kv = model.new_kv_cache(16, BLOCK)
    mk = MegakernelDecoder(model, kv, max_batch=1, max_context=32, tiles=TILES, num_programs=2, prefetch=prefetch)
    seq = SequenceKV(kv)
    tok = _prefill(model, kv, seq, [5, 6, 7])
    s = mk.static(1)
    mk.fill(s, decode_step([seq], [tok], [3]))
    # the first O_PROJ now waits for one more signal than attention will ever send
    i = next(j for j, r in enumerate(s.tasks.tolist()) if r[0] == Op.O_PROJ)
    s.tasks[i, WAIT_COUNT] += 1
    t0 = time.perf_counter()
    # a bound far above any legitimate wait on a GPU (µs), small for the interpreter
    launch(s, mk.W, kv.k, kv.v, mk.inv_freq, mk.num_programs, max_spins=50 if DEV == "cpu" else 200_000,
           prefetch=prefetch)
    # the error names the first wait to run out of spins: the starved O_PROJ itself, or (on a GPU, where
    # that task's prefetching spins are slower than a plain poll) the GATE_UP waiting on its tile
    with pytest.raises(MegakernelError, match=rf"task ({i} \(O_PROJ, layer 0.*timed out.*attn_done"
                                              rf"|\d+ \(GATE_UP, layer 0.*timed out.*o_done\[0\])"):
        check(s)
    assert time.perf_counter() - t0 < 60
    # the runtime recovers: counters are re-zeroed and a repaired plan runs again
    s.tasks[i, WAIT_COUNT] -= 1
    logits = mk.forward(decode_step([seq], [tok], [3]))
    ref_kv = model.new_kv_cache(16, BLOCK)
    ref_seq = SequenceKV(ref_kv)
    _prefill(model, ref_kv, ref_seq, [5, 6, 7])
    ref = model.forward(decode_step([ref_seq], [tok], [3]), ref_kv).cpu()
    assert (logits - ref).abs().max().item() < 1e-4


def test_unsupported_models_are_refused():
    cfg = shape_config("tiny")
    model = random_llama(cfg, seed=13)
    model.layers[0].q_norm = torch.ones(cfg.head_dim)
    with pytest.raises(ValueError, match="norm"):
        MegakernelDecoder(model, model.new_kv_cache(8, BLOCK), max_batch=1, max_context=16)


TRITON36 = Path(__file__).resolve().parents[2] / "build" / "venv-triton36" / "bin" / "python"


@pytest.mark.parametrize("triton_build", ["installed", "triton-3.6"])
@pytest.mark.parametrize("shape,batch,profile", [
    ("dense-1B", 1, True), ("dense-8B", 1, False), ("dense-1B", 4, False), ("dense-1B", 8, False),
    ("dense-8B", 8, False),
])
def test_megakernel_compiles_for_hopper(shape, batch, profile, triton_build):
    """Triton's ahead-of-time compiler, targeting sm_90a, on the benchmark shapes (no GPU needed); a
    ptxas error fails. Spill stack <= 64 bytes; every matvec call site's K loop loads its weights 16
    bytes at a time and, at batch 1-2, holds no barrier (no layout conversion through shared memory).
    In a subprocess: this process runs Triton's interpreter, which replaces the JIT functions. Also
    with the GPU machine's Triton 3.6 when `bash benchmarks/triton36_venv.sh` has made its venv."""
    python = sys.executable
    if triton_build == "triton-3.6":
        if not TRITON36.exists():
            pytest.skip(f"no Triton 3.6 venv at {TRITON36} (run `bash benchmarks/triton36_venv.sh`)")
        python = str(TRITON36)
    prefetch = int(profile)   # the profiled variant also carries the L2 prefetch
    code = f"""
import ast, sys
sys.path.insert(0, "benchmarks")
import sass
from slipstream.models.random_init import shape_config
from slipstream.runtime import megakernel as mk
from slipstream.runtime.plan import WeightLayout, compile_plan
cfg = shape_config({shape!r})
plan = compile_plan(cfg, {batch}, 512, 16, WeightLayout.for_config(cfg, cfg.tie_word_embeddings),
                    mk.default_tiles(cfg, 512, 132))
kernel = mk.compile_offline(plan, profile={profile}, prefetch={prefetch})
ptx = kernel.asm["ptx"]
assert ("globaltimer" in ptx) == {profile}
use = mk.resource_usage(kernel.asm["cubin"])
assert use["stack"] <= 64, use
from slipstream.kernels.triton import megakernel as kernel_src
src = open(kernel_src.__file__).read()
lines_of = src.splitlines()
calls = {{i + 1 for i, t in enumerate(lines_of) if "_mv_tile(" in t and "def " not in t}}
# the helpers' own lines (Triton 3.6 attributes inlined code to them, 3.9 to the call site)
helpers = set()
for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.FunctionDef) and node.name in ("_mv_wide", "_mv_rows", "_mv_dot"):
        helpers |= set(range(node.body[0].lineno, node.end_lineno + 1))
seen, found = set(), 0
for lp in sass.loops(sass.disassemble(kernel.asm["cubin"])):
    lines = {{ln for f, ln in lp.lines() if f == "megakernel.py"}}
    if not lp.innermost or not (lines & (calls | helpers)):
        continue
    seen |= lines & calls
    found += 1
    # 16-byte loads, or at batch 4-8 (`_mv_dot`) 16-byte asynchronous copies (cp.async)
    assert lp.counts["LDG16"] + lp.counts["LDGSTS16"] >= 1, (sorted(lines)[:8], lp.summary())
    if {batch} <= 2:
        assert lp.counts["BAR"] == 0 and lp.counts["SHFL"] == 0, (sorted(lines)[:8], lp.summary())
# every call site has its loop (ptxas may merge two identical ones: O and DOWN share a tile shape);
# where the line info names only the helpers (Triton 3.6), at least one loop per distinct tile shape
assert len(seen) >= len(calls) - 1 if seen else found >= 3, (sorted(seen), sorted(calls), found)
print("entry" if ".entry _megakernel" in ptx else "no entry")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("entry") and "no entry" not in out.stdout
