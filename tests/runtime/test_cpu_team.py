"""The CPU step as one native call (runtime/cpu_team.py) against the eager torch step.

The exact path (fp32 activations) must match eager within float32 summation noise and give the same
greedy tokens; the fast path (int8 activations) must stay close; neither may depend on the number
of threads in the team or on what else shares the step."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import pytest
import torch
from support import decode_step, prefill_step

from slipstream.kernels.cpu import load_library
from slipstream.kv.blocks import SequenceKV
from slipstream.models.llama import LlamaModel
from slipstream.models.random_init import random_llama, shape_config
from slipstream.runtime import cpu_plan
from slipstream.runtime.cpu_team import (
    CpuTeamDecoder,
    RopeTable,
    bf16_blas_fast,
    code_share,
    half_float_share,
    tile_share,
)
from slipstream.step import StepBuilder, decode_rows
from slipstream.weights.quant import Q4_F32, Q8_0, Linear

pytestmark = pytest.mark.skipif(load_library() is None, reason="native CPU kernels unavailable")


def _quantize(w: Linear, bits: int) -> Linear:
    """Packs a dense matrix per group of 32 (8-bit symmetric or 4-bit with a min), for tests."""
    x = w.data.view(w.n, w.k // 32, 32)
    if bits == 8:
        d = x.abs().amax(-1) / 127
        q = torch.round(x / d.clamp_min(1e-12)[..., None]).clamp(-127, 127).to(torch.int8)
        return Linear(w.n, w.k, q.reshape(w.n, w.k).contiguous(), Q8_0, d.contiguous(), bias=w.bias)
    lo, hi = x.amin(-1), x.amax(-1)
    d = (hi - lo) / 15
    q = torch.round((x - lo[..., None]) / d.clamp_min(1e-12)[..., None]).clamp(0, 15).to(torch.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(w.n, w.k // 2).contiguous()
    return Linear(w.n, w.k, packed, Q4_F32, d.contiguous(), lo.contiguous(), bias=w.bias)


def _packed_random(qwen: str | None = None, head_dim: int = 32) -> LlamaModel:
    cfg = shape_config("tiny", hidden_size=128, head_dim=head_dim, intermediate_size=256, num_layers=2)
    m = random_llama(cfg, seed=7)
    g = torch.Generator().manual_seed(3)
    layers = []
    for L in m.layers:
        qkv = L.qkv
        if qwen == "qwen2":
            qkv = Linear(qkv.n, qkv.k, qkv.data, bias=torch.randn(qkv.n, generator=g) * 0.1)
        layers.append(dataclasses.replace(
            L, qkv=_quantize(qkv, 4), o=_quantize(L.o, 8), gate_up=_quantize(L.gate_up, 4), down=_quantize(L.down, 4),
            q_norm=1 + 0.1 * torch.randn(head_dim, generator=g) if qwen == "qwen3" else None,
            k_norm=1 + 0.1 * torch.randn(head_dim, generator=g) if qwen == "qwen3" else None))
    m.layers = layers
    m.embed = m.lm_head = _quantize(m.embed, 8)
    return m


def _run(model: LlamaModel, prompts: list[list[int]], steps: int, exact: bool, threads: int | None = None):
    """Prefill both caches eagerly, then decode `steps` steps with eager and with the team, each fed
    eager's greedy tokens; yields (eager logits, team logits) per step."""
    kv_e, kv_t = model.new_kv_cache(64), model.new_kv_cache(64)
    team = CpuTeamDecoder(model, kv_t, exact=exact, threads=threads)
    seqs_e, seqs_t = [SequenceKV(kv_e) for _ in prompts], [SequenceKV(kv_t) for _ in prompts]
    tokens = []
    for p, se, st in zip(prompts, seqs_e, seqs_t):
        tokens.append(int(model.forward(prefill_step(se, p, extra=steps + 2), kv_e).argmax()))
        model.forward(prefill_step(st, p, extra=steps + 2), kv_t)
    positions = [len(p) for p in prompts]
    out = []
    for _ in range(steps):
        le = model.forward(decode_step(seqs_e, tokens, positions), kv_e)
        lt = team.forward(decode_step(seqs_t, tokens, positions))
        out.append((le, lt))
        tokens = le.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    return out


PROMPTS = [[[1, 504, 3458, 282, 4649]], [[1, 22, 333], [5, 6, 7, 8, 9, 10, 11], [42]]]


@pytest.mark.parametrize("prompts", PROMPTS)
def test_exact_matches_eager_on_smollm2(smollm2, prompts):
    for le, lt in _run(smollm2, prompts, 5, exact=True):
        assert (le - lt).abs().max().item() < 1e-3      # logits are ~20 in size
        assert le.argmax(-1).tolist() == lt.argmax(-1).tolist()


def test_fast_stays_close_to_eager_on_smollm2(smollm2):
    rel, agree, total = [], 0, 0
    for le, lt in _run(smollm2, PROMPTS[1], 6, exact=False):
        rel.append(((lt - le).norm() / le.norm()).item())
        agree += (le.argmax(-1) == lt.argmax(-1)).sum().item()
        total += le.shape[0]
    assert max(rel) < 0.03, rel
    assert agree >= total - 2, (agree, total)


@pytest.mark.parametrize("qwen", [None, "qwen2", "qwen3"])
@pytest.mark.parametrize("head_dim", [32, 48])
def test_exact_matches_eager_on_packed_random_models(qwen, head_dim):
    """q/k/v biases (Qwen2), per-head q/k norms (Qwen3), and a head size that is not a multiple of 32
    (its attention output is quantized by a separate task)."""
    model = _packed_random(qwen, head_dim)
    for le, lt in _run(model, [[1, 2, 3], [9, 8, 7, 6, 5, 4]], 4, exact=True):
        torch.testing.assert_close(lt, le, rtol=1e-4, atol=1e-4)
    for le, lt in _run(model, [[1, 2, 3]], 3, exact=False):
        assert ((lt - le).norm() / le.norm()).item() < 0.05


def test_results_do_not_depend_on_thread_count(smollm2):
    """Each output element is computed by one task in a fixed order: bitwise the same with 1 and 2
    threads (the team is resized in between)."""
    one = _run(smollm2, PROMPTS[1], 3, exact=True, threads=1)
    three = _run(smollm2, PROMPTS[1], 3, exact=True, threads=2)
    for (_, a), (_, b) in zip(one, three):
        assert torch.equal(a, b)
    fast1 = _run(smollm2, PROMPTS[0], 2, exact=False, threads=1)
    fast2 = _run(smollm2, PROMPTS[0], 2, exact=False, threads=2)
    for (_, a), (_, b) in zip(fast1, fast2):
        assert torch.equal(a, b)


def test_the_eager_paths_openmp_regions_follow_the_teams_size():
    """The library's OpenMP regions outside the step (the eager path's products, the widening of weights for
    BLAS) run as many threads as the team has, so a team shrunk beside a busy neighbour (cpu_load.py) does
    not leave them on every core."""
    from slipstream.runtime.cpu_team import default_threads
    lib = load_library()
    try:
        for n in (1, 2):
            assert lib.ss_team_configure(n, -1, -1) == n
            assert lib.ss_parallel_probe() == n
    finally:
        lib.ss_team_configure(default_threads(), -1, -1)


@pytest.mark.parametrize("f16", [False, True])
def test_long_contexts_are_split_and_merged(f16):
    """Contexts of 512 tokens and more are attended in parts (n // 256 of them, up to 8) that the team
    shares, merged in part order: the same logits as eager (exact path) and bitwise the same row
    whatever the team's size and whatever other rows share the step (4 rows on 2 threads: each task takes
    all of a row's KV heads, cpu_plan.attention_whole_rows; fewer rows: a task per KV head)."""
    model = _packed_random(None, 32)
    contexts = [1100, 600, 40, 2100]           # 4, 2, 1 and 8 parts
    kv = model.new_kv_cache(sum(-(-(c + 2) // 16) for c in contexts) + 4,
                            dtype=torch.float16 if f16 else torch.float32)
    g = torch.Generator().manual_seed(5)
    seqs = [SequenceKV(kv) for _ in contexts]
    for s, n in zip(seqs, contexts):
        model.forward(prefill_step(s, torch.randint(3, 250, (n,), generator=g).tolist(), extra=2), kv)

    def step(rows: list[int]):   # token 7 at each row's next position (rewriting the same KV each time)
        return decode_step([seqs[i] for i in rows], [7] * len(rows), [contexts[i] for i in rows])
    teams = {t: CpuTeamDecoder(model, kv, exact=True, threads=t) for t in (1, 2)}
    eager = model.forward(step([0, 1, 2, 3]), kv)
    torch.testing.assert_close(teams[2].forward(step([0, 1, 2, 3])), eager, rtol=1e-4, atol=1e-4)
    alone = teams[1].forward(step([0]))[0]
    for threads, rows in ((2, [0]), (2, [0, 2]), (2, [3, 2, 0, 1]), (1, [1, 0])):
        got = teams[threads].forward(step(rows))
        assert torch.equal(got[rows.index(0)], alone), (threads, rows)


def test_tokens_only_is_the_argmax_of_the_logits(smollm2):
    kv = smollm2.new_kv_cache(64)
    team = CpuTeamDecoder(smollm2, kv)
    seqs = [SequenceKV(kv) for _ in range(3)]
    for s, p in zip(seqs, [[1, 2], [3, 4, 5], [6]]):
        smollm2.forward(prefill_step(s, p), kv)
    step = decode_step(seqs, [10, 11, 12], [2, 3, 1])
    logits = team.forward(step)
    tokens = team.forward(step, tokens_only=True)   # same step again: same KV writes, same maths
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_verification_rows_of_one_sequence(smollm2):
    """Speculative verification: a sequence's last token and its guesses as separate rows, each row
    attending to the rows before it (written to the cache in the same step)."""
    kv_e, kv_t = smollm2.new_kv_cache(64), smollm2.new_kv_cache(64)
    team = CpuTeamDecoder(smollm2, kv_t, exact=True)
    se, st = SequenceKV(kv_e), SequenceKV(kv_t)
    prompt = [1, 504, 3458, 282]
    smollm2.forward(prefill_step(se, prompt), kv_e)
    smollm2.forward(prefill_step(st, prompt), kv_t)
    steps = []
    for seq in (se, st):
        b = StepBuilder()
        b.add(seq, [4649, 30, 31, 32], start=len(prompt), as_rows=True, logits="all")
        steps.append(b.build())
    le = smollm2.forward(steps[0], kv_e)
    lt = team.forward(steps[1])
    assert lt.shape == le.shape == (4, smollm2.cfg.vocab_size)
    assert (le - lt).abs().max().item() < 1e-3


@pytest.mark.parametrize("gather", [False, True])
def test_prompt_chunks_beside_a_decode_row(smollm2, gather):
    """A prefill step on the team: one sequence's chunk after a cached prefix, a whole new prompt
    and a decode row, in one step. Logits of the rows asked for and the KV the chunks leave behind
    equal the eager step's; the next decode step over that KV agrees too."""
    kv_e, kv_t = smollm2.new_kv_cache(96), smollm2.new_kv_cache(96)
    team = CpuTeamDecoder(smollm2, kv_t, exact=True)
    first, chunk, fresh, lone = [1, 504, 3458, 282, 9, 11], [4649, 30, 31, 32, 33, 34, 35], [1, 77, 78], [5, 6]
    seqs = {}
    for name, kv in (("e", kv_e), ("t", kv_t)):
        a, b, c = SequenceKV(kv), SequenceKV(kv), SequenceKV(kv)
        for s, n in ((a, 20), (b, 8), (c, 8)):
            s.reserve(n)
        smollm2.forward(prefill_step(a, first), kv)
        smollm2.forward(prefill_step(c, lone), kv)
        seqs[name] = (a, b, c)
    steps = {}
    for name in ("e", "t"):
        a, b, c = seqs[name]
        sb = StepBuilder()
        sb.add(a, chunk, start=len(first), logits="all", gather=gather)
        sb.add(b, fresh, start=0, gather=gather)
        sb.add(c, [7], start=len(lone), gather=gather)
        steps[name] = sb.build()
    le = smollm2.forward(steps["e"], kv_e)
    lt = team.forward(steps["t"])
    assert lt.shape == le.shape == (len(chunk) + 2, smollm2.cfg.vocab_size)
    assert (le - lt).abs().max().item() < 1e-3
    assert torch.equal(le.argmax(-1), lt.argmax(-1))
    assert torch.equal(team.forward(steps["t"], tokens_only=True), lt.argmax(-1))   # a re-run writes the same KV
    # the KV the chunks wrote: one more decode step per sequence over it
    positions = [len(first) + len(chunk), len(fresh), len(lone) + 1]
    tokens = [int(t) for t in le.argmax(-1)[[len(chunk) - 1, len(chunk), len(chunk) + 1]]]
    de = smollm2.forward(decode_step(list(seqs["e"]), tokens, positions), kv_e)
    dt = team.forward(decode_step(list(seqs["t"]), tokens, positions))
    assert (de - dt).abs().max().item() < 1e-3


def test_prompt_chunk_tokens_only_picks_the_chunks_last_row(smollm2):
    kv = smollm2.new_kv_cache(64)
    team = CpuTeamDecoder(smollm2, kv, exact=False)
    s = SequenceKV(kv)
    s.reserve(16)
    step = prefill_step(s, [1, 504, 3458, 282, 9, 11, 4649])
    logits = team.forward(step)
    assert logits.shape == (1, smollm2.cfg.vocab_size)
    assert team.forward(step, tokens_only=True).tolist() == [int(logits.argmax())]


def test_plan_validator_rejects_broken_tables():
    shape = cpu_plan.Shape(2, 64, 4, 2, 16, 128, 256)
    table = cpu_plan.build(shape, rows=2, threads=2, argmax=True)
    cpu_plan.validate(table, shape, 2)
    late = table.copy()
    late[5, cpu_plan.WAIT_EV] = late[-1, cpu_plan.SIG_EV]     # waits on the last task's event
    late[5, cpu_plan.WAIT_COUNT] = 2
    with pytest.raises(cpu_plan.CpuPlanError, match="after it"):
        cpu_plan.validate(late, shape, 2)
    short = table.copy()
    short[-1, cpu_plan.WAIT_COUNT] += 1
    with pytest.raises(cpu_plan.CpuPlanError, match="signals"):
        cpu_plan.validate(short, shape, 2)
    gap = np.delete(table, np.where(table[:, cpu_plan.OP] == cpu_plan.DOWN)[0][:1], axis=0)
    with pytest.raises(cpu_plan.CpuPlanError):
        cpu_plan.validate(gap, shape, 2)


def test_plan_validator_checks_attention_tasks():
    shape = cpu_plan.Shape(2, 64, 4, 2, 16, 128, 256)
    table = cpu_plan.build(shape, rows=1, threads=2, argmax=True)
    attn = np.where(table[:, cpu_plan.OP] == cpu_plan.ATTN)[0]
    assert {t >> 8 for t in table[attn, cpu_plan.AUX]} == {cpu_plan.attention_parts(1, 2, 2)} == {2}
    dup = table.copy()
    dup[attn[1], cpu_plan.AUX] = dup[attn[0], cpu_plan.AUX]   # task 0 twice, task 1 never
    with pytest.raises(cpu_plan.CpuPlanError, match="tasks"):
        cpu_plan.validate(dup, shape, 1)


def test_attention_tasks_take_whole_rows_when_rows_fill_the_team():
    shape = cpu_plan.Shape(2, 64, 4, 2, 16, 128, 256)
    for rows, whole in ((1, False), (3, False), (4, True), (8, True)):
        table = cpu_plan.build(shape, rows=rows, threads=2, argmax=True)
        cpu_plan.validate(table, shape, rows)
        heads = set(table[table[:, cpu_plan.OP] == cpu_plan.ATTN, cpu_plan.T1].tolist())
        assert heads == ({cpu_plan.ALL_HEADS} if whole else {0, 1}), rows
    attn = np.where(table[:, cpu_plan.OP] == cpu_plan.ATTN)[0]
    twice = table.copy()
    twice[attn[0], cpu_plan.T1] = 0   # row 0's KV head 0 also in a whole-row task: attended twice
    with pytest.raises(cpu_plan.CpuPlanError):
        cpu_plan.validate(twice, shape, 8)
    missing = np.delete(table, attn[:1], axis=0)
    with pytest.raises(cpu_plan.CpuPlanError):
        cpu_plan.validate(missing, shape, 8)


@pytest.mark.parametrize("rows,threads,blocks", [(1, 2, [(0, 1)]), (8, 1, [(0, 8)]), (8, 2, [(0, 4), (4, 8)]),
                                                  (5, 2, [(0, 3), (3, 5)]), (3, 8, [(0, 1), (1, 2), (2, 3)]),
                                                  (20, 2, [(0, 8), (8, 16), (16, 20)])])
def test_norm_tasks_share_the_rows_among_the_threads(rows, threads, blocks):
    """Each RMSNorm (before attention, before the MLP, the final one) is split by rows: at most NORM_ROWS per
    task, and no more than a thread's share, so no thread waits while another normalises every row."""
    shape = cpu_plan.Shape(2, 64, 4, 2, 16, 128, 256)
    table = cpu_plan.build(shape, rows=rows, threads=threads, argmax=True)
    cpu_plan.validate(table, shape, rows)
    norms = table[table[:, cpu_plan.OP] == cpu_plan.NORM]
    for layer, aux in ((0, cpu_plan.NORM_ATTN), (1, cpu_plan.NORM_FFN), (-1, cpu_plan.NORM_FINAL)):
        mine = norms[(norms[:, cpu_plan.LAYER] == layer) & (norms[:, cpu_plan.AUX] == aux)]
        assert [tuple(r) for r in mine[:, [cpu_plan.T0, cpu_plan.T1]].tolist()] == blocks
        assert len(set(mine[:, cpu_plan.SIG_EV].tolist())) == 1   # one event, signalled by them all


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_plans_validate_for_many_shapes(threads):
    for rows in (1, 3, 8, 17):
        shape = cpu_plan.Shape(3, 576, 9, 3, 64, 1536, 49152)
        cpu_plan.validate(cpu_plan.build(shape, rows, threads, argmax=rows % 2 == 1), shape, rows)
        for out in (0, 1, rows // 2):   # prompt chunks: logits of some rows, or none
            table = cpu_plan.build(shape, rows, threads, argmax=True, out_rows=out)
            cpu_plan.validate(table, shape, rows)
            assert (table[:, cpu_plan.OP] == cpu_plan.ARGMAX).sum() == out
            assert ((table[:, cpu_plan.OP] == cpu_plan.LM_HEAD).sum() > 0) == (out > 0)


def _raw(qtype: int, n: int, k: int, seed: int) -> Linear:
    """A matrix stored as hand-built ggml blocks of `qtype`, weights of about 1/sqrt(k)."""
    from support import random_blocks

    from slipstream.weights.quant import RAW_TYPES
    if qtype in (1, 30):   # F16, BF16
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
        return Linear.from_raw(qtype, w.to(torch.float16 if qtype == 1 else torch.bfloat16).view(torch.uint8), n, k)
    blocks = random_blocks(qtype, n, k, seed, size=2.0 / k ** 0.5)
    return Linear.from_raw(qtype, blocks, n, k) if qtype in RAW_TYPES else Linear.from_blocks(qtype, blocks, n, k)


# ggml type ids: every type the loader keeps as raw blocks, with a V of another type in the fused
# QKV (a chain of two layouts, as in Q4_K_M files)
RAW_QTYPES = {"Q5_0": 6, "Q5_1": 7, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20,
              "IQ4_XS": 23, "F16": 1, "BF16": 30}


@pytest.mark.parametrize("name", list(RAW_QTYPES))
def test_every_block_type_on_the_native_step(name):
    from slipstream.weights.quant import concat_rows
    qt = RAW_QTYPES[name]
    cfg = shape_config("tiny", hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=512,
                       num_layers=2)
    m = random_llama(cfg, seed=11)
    layers = []
    for i, L in enumerate(m.layers):
        hd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = concat_rows([_raw(qt, hd, cfg.hidden_size, 10 * i), _raw(qt, kvd, cfg.hidden_size, 10 * i + 1),
                           _raw(14 if qt != 14 else 8, kvd, cfg.hidden_size, 10 * i + 2)])
        layers.append(dataclasses.replace(
            L, qkv=qkv, o=_raw(qt, cfg.hidden_size, hd, 10 * i + 3),
            gate_up=_raw(qt, 2 * cfg.intermediate_size, cfg.hidden_size, 10 * i + 4),
            down=_raw(qt, cfg.hidden_size, cfg.intermediate_size, 10 * i + 5)))
    m.layers = layers
    m.embed = m.lm_head = _raw(qt, cfg.vocab_size, cfg.hidden_size, 99)
    for le, lt in _run(m, [[1, 2, 3], [9, 8, 7, 6, 5, 4]], 3, exact=True):
        torch.testing.assert_close(lt, le, rtol=1e-4, atol=1e-4)
        assert le.argmax(-1).tolist() == lt.argmax(-1).tolist()
    alone = _run(m, [[1, 2, 3]], 2, exact=False)
    for le, lt in alone:
        assert ((lt - le).norm() / le.norm()).item() < 0.05
    # the fast path's batch invariance: the row's logits bit for bit beside seven others (Q6_K's failed it)
    beside = _run(m, [[1, 2, 3], [9, 8, 7, 6, 5, 4], [42], [7, 7], [5, 6], [3], [9, 9, 9], [1, 2]], 2, exact=False)
    for (_, a), (_, b) in zip(alone, beside):
        assert torch.equal(a[0], b[0])


def _amx(on: bool) -> bool:
    return bool(load_library().ss_set_amx(int(on)))


@pytest.mark.skipif(load_library() is None or load_library().ss_tile_planes() != 1,
                    reason="no 512-bit VNNI in this build (the twin's instructions)")
@pytest.mark.parametrize("model_name", ["smollm2", "qwen2"])
def test_amx_tiles_in_the_step_agree_with_the_vector_kernels(model_name, request):
    """Eight decode rows on the fast path: on AMX tiles (where the CPU has them) with 2 and 1 threads, on
    the tiles' vector twin alone, and on the AVX2 builds' kernels ("paired": the twin off, since 2026-11-29
    the 8-row kernels with one sum). Tiles and twin give bitwise the same logits (amx.h). The AVX2 kernels
    sum in another fp32 order; a rounding difference that moves an activation
    code by one step travels through the layers, so they are compared as the fast path is with eager (within
    3% of the norm; on smollm2 the paired kernels measure 0.8-1.5%, the tiles 1.0-1.9%), and the greedy
    tokens agree. The Qwen2-shaped model adds q/k/v biases, q8 O rows and q4 matrices with fp32 scales."""
    lib = load_library()
    model = request.getfixturevalue("smollm2") if model_name == "smollm2" else _packed_random("qwen2")
    prompts = [[1, 22, 33], [5, 6, 7, 8, 9, 10, 11], [42], [7, 7], [100, 200, 30, 40], [3], [9, 9, 9], [1, 2]]
    try:
        results = {}
        for name, amx, twin, threads in (("tiles", True, True, 2), ("tiles1", True, True, 1),
                                         ("twin", False, True, 2), ("paired", False, False, 2)):
            _amx(amx)
            lib.ss_set_twin(int(twin))
            results[name] = _run(model, prompts, 3, exact=False, threads=threads)
    finally:
        lib.ss_set_twin(1)
        _amx(True)
    agree = total = 0
    for (eager, tiles), (_, tiles1), (_, twin), (_, paired) in zip(*(results[k] for k in ("tiles", "tiles1", "twin", "paired"))):
        assert torch.equal(tiles, tiles1) and torch.equal(tiles, twin)
        assert ((tiles - eager).norm() / eager.norm()).item() < 0.03
        assert ((paired - eager).norm() / eager.norm()).item() < 0.03
        agree += (tiles.argmax(-1) == paired.argmax(-1)).sum().item()
        total += len(prompts)
    assert agree >= total - 1, (agree, total)


@pytest.mark.parametrize("local_rope,f16,exact", [(False, False, False), (True, False, False), (False, True, False),
                                                 (False, False, True)])
def test_rows_given_as_lists_are_the_same_step(local_rope, f16, exact):
    """`forward_rows` (a decode step as lists, its arrays filled in place, rotary rows looked up in a
    table) computes bitwise what `forward` computes from the same step as tensors: one row reading a
    slot range, one row reading scattered slot ids, a row of 600 tokens of context (attended in parts),
    several rows of both kinds, and ten rows (past the first buffers' eight); logits and greedy tokens.
    With `local_rope` the sliding layers rotate with a base of their own (Gemma 3); also an fp16 cache
    and the exact path."""
    extra = dict(layer_types=("sliding", "sliding"), sliding_window=64, rope_local_theta=10000.0,
                 rope_theta=1e6) if local_rope else {}
    cfg = shape_config("tiny", hidden_size=128, head_dim=32, intermediate_size=256, num_layers=2, **extra)
    model = random_llama(cfg, seed=11)
    assert (model.inv_freq_local is not None) == local_rope
    kv = model.new_kv_cache(80, dtype=torch.float16 if f16 else torch.float32)
    team = CpuTeamDecoder(model, kv, exact=exact)
    assert not team._hybrid                        # (a hybrid cache's steps go through `forward`)
    runs = [SequenceKV(kv) for _ in range(10)]
    runs[0].reserve(40)                            # consecutive blocks: a slot range
    for _ in range(3):                             # interleaved blocks: scattered slot ids
        runs[1].reserve(16 * (len(runs[1].block_table) + 1))
        runs[2].reserve(16 * (len(runs[2].block_table) + 1))
    g = torch.Generator().manual_seed(2)
    prompts = [[1, 5, 9, 14, 2, 7], list(range(3, 40)), [4, 8, 15, 16, 23],
               torch.randint(3, 250, (600,), generator=g).tolist()] + [[30 + i, 2, 9] for i in range(6)]
    for s, p in zip(runs, prompts):
        model.forward(prefill_step(s, p, extra=4), kv)
    assert isinstance(runs[0].read_ids(7), tuple) and isinstance(runs[1].read_ids(38), np.ndarray)
    for rows in ([0], [1], [3], [2, 0, 1], [1, 2], list(range(10)), [0]):
        seqs = [runs[i] for i in rows]
        positions = [len(prompts[i]) for i in rows]
        lists = decode_rows(seqs, [20 + i for i in rows], positions)
        tensors = lists.step()
        assert torch.equal(tensors.write_slots, torch.cat([s.slots(p, p + 1) for s, p in zip(seqs, positions)]))
        for s, p, r in zip(seqs, positions, lists.reads):
            want = s.read_slots(p + 1)
            assert r == want if isinstance(want, tuple) else torch.equal(torch.from_numpy(r), want)
        want = team.forward(tensors)               # each step rewrites the same KV entries
        assert torch.equal(team.forward_rows(lists), want), rows
        assert team.forward_rows(lists, tokens_only=True) == want.argmax(-1).tolist()
    with pytest.raises(ValueError):
        team.forward_rows(decode_rows([runs[0]], [1], [-1]))
    with pytest.raises(ValueError):
        team.forward_rows(decode_rows([], [], []))
    vocab = model.embed.n   # the native lookup reads row `id` of the table: ids outside it are refused
    for bad in (vocab, -1, 10 ** 9):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            team.forward_rows(decode_rows([runs[0], runs[2]], [5, bad], [len(prompts[0]), len(prompts[2])]))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            team.forward(decode_rows([runs[0]], [bad], [len(prompts[0])]).step())
    assert torch.equal(team.forward_rows(lists), want)   # and the team still runs


@pytest.mark.parametrize("rotary", [2, 16, 20, 64, 96, 128])
@pytest.mark.parametrize("base", [10000.0, 1e6])
def test_rotary_table_rows_equal_the_angles_computed_per_step(rotary, base):
    """What the native step read before the table: cos and sin of float32(position) x inv_freq, computed
    per step (any width: the vectorised loops' tails included)."""
    inv = 1.0 / (base ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    table = RopeTable(inv)
    positions = torch.tensor([0, 1, 17, 255, 256, 5000, 3, 131071])
    cos, sin = table.rows(positions)
    freqs = positions.to(torch.float32)[:, None] * inv[None, :]
    assert torch.equal(cos, freqs.cos()) and torch.equal(sin, freqs.sin())
    assert len(table.cos) >= 131072 and table.cos_addr == table.cos.ctypes.data


def _q4k_random(n: int, k: int, rng: np.random.Generator) -> Linear:
    """A Q4_K matrix of random super-blocks (random 6-bit scales, mins and codes; small fp16 d, dmin), loaded
    as a GGUF's is."""
    from slipstream.weights.gguf import _q4k_linear
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    for lo, hi in ((0, 2), (2, 4)):
        blocks[..., lo:hi] = rng.uniform(0.001, 0.01, (n, k // 256)).astype(np.float16)[..., None].view(np.uint8)
    return _q4k_linear(blocks.reshape(-1), n, k)


def _with_planes(w: Linear) -> Linear:
    """The same Q4_K matrix holding fp32 scale and min planes (as a Q4_K matrix was kept before) instead of
    its 6-bit form (other matrices as they are)."""
    if w.kq is None:
        return w
    scale, mins = w.planes()
    return Linear(w.n, w.k, w.data, w.fmt, scale, mins)


def _q4k_models(cfg, rng):
    """Two copies of a random Llama whose products (O where its input allows), embedding and LM head are the
    same Q4_K matrices: the
    first keeps their 6-bit scales (as the GGUF loader does), the second fp32 planes of them."""
    compact = random_llama(cfg, seed=3)
    compact.layers = [dataclasses.replace(L, qkv=_q4k_random(L.qkv.n, L.qkv.k, rng),
                                          o=_q4k_random(L.o.n, L.o.k, rng) if L.o.k % 256 == 0 else L.o,
                                          gate_up=_q4k_random(L.gate_up.n, L.gate_up.k, rng),
                                          down=_q4k_random(L.down.n, L.down.k, rng)) for L in compact.layers]
    compact.embed = compact.lm_head = _q4k_random(cfg.vocab_size, cfg.hidden_size, rng)
    planes = random_llama(cfg, seed=3)
    planes.layers = [dataclasses.replace(L, **{f: _with_planes(getattr(L, f)) for f in ("qkv", "o", "gate_up", "down")})
                     for L in compact.layers]
    planes.embed = planes.lm_head = _with_planes(compact.embed)
    return compact, planes


@pytest.mark.parametrize("path", ["fast", "paired", "exact"])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_q4_k_six_bit_scales_give_the_planes_results(path, head_dim):
    """A Q4_K matrix keeps only its 6-bit scales and mins and the super-blocks' fp16 d and dmin; the kernels widen
    a row's scales as they go (and the AVX-512 VNNI kernels read a compact tile copy). The step's logits are
    bitwise those of the same model holding fp32 planes, at 1 row and 8 (tiles where the CPU has them), on the
    fast path, on the paired kernels (the twin off: what AVX2 machines run) and on the exact path, with a Q4_K
    embedding. Head size 40 puts query/key/value row ranges off blocks of 16 rows."""
    rng = np.random.default_rng(4)
    heads = dict(num_heads=4, num_kv_heads=1) if head_dim == 40 else {}
    cfg = shape_config("tiny", hidden_size=256, head_dim=head_dim, intermediate_size=512, num_layers=2, **heads)
    compact, planes = _q4k_models(cfg, rng)
    lib = load_library()
    outs = []
    try:
        lib.ss_set_twin(int(path != "paired"))
        for model in (compact, planes):
            kv = model.new_kv_cache(16)
            team = CpuTeamDecoder(model, kv, exact=path == "exact")
            seqs = [SequenceKV(kv) for _ in range(8)]
            for i, s in enumerate(seqs):
                model.forward(prefill_step(s, [1 + i, 7, 9 + i], extra=4), kv)
            outs.append([team.forward(decode_step(seqs[:b], [3 + b] * b, [3] * b)) for b in (1, 8)])
    finally:
        lib.ss_set_twin(1)
    tiled = lib.ss_tile_planes() != 0   # the compact tile copy where the kernels read one
    assert {len(getattr(L.qkv, "_planes_by_tile", ())) for L in compact.layers} == ({3} if tiled else {0})
    assert all(L.qkv.scale is None and L.qkv.kq is not None for L in compact.layers)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[0][1].abs().max() > 0


def test_q4_k_keeps_under_its_file_size():
    """What a Q4_K matrix holds: its 4-bit codes and 2.5 bytes of scales per 32 weights (4.625 bits per weight;
    the file's blocks 4.5, the fp32 planes it held before 6); the planes other readers want are made on demand,
    equal to the dequantized weights'."""
    w = _q4k_random(64, 512, np.random.default_rng(6))
    assert w.scale is None and w.min is None
    assert w.nbytes == 64 * 512 // 2 + 64 * 512 // 32 * 2 + 64 * 512 // 256 * 4 <= 1.03 * 64 * 512 * 4.5 / 8
    scale, mins = w.planes()
    codes = torch.cat([w.data.view(64, 16, 16) & 15, w.data.view(64, 16, 16) >> 4], dim=-1).to(torch.float32)
    assert torch.equal(w.dequantize(), (scale.unsqueeze(-1) * codes + mins.unsqueeze(-1)).view(64, 512))
    assert torch.equal(w.widen(load_library()), w.dequantize())   # the eager prompt path's native widening


def test_stacked_q4_k_rows_keep_their_compact_scales():
    """Fused QKV or gate/up of Q4_K rows (and a Q4_K_M file's Q4_K query/key rows beside Q6_K value rows,
    kept as parts) carry the 6-bit scales of every row, in row order."""
    from support import random_blocks

    from slipstream.weights.quant import concat_rows
    rng = np.random.default_rng(5)
    a, b = _q4k_random(64, 256, rng), _q4k_random(32, 256, rng)
    v = Linear.from_raw(14, random_blocks(14, 32, 256), 32, 256)   # Q6_K
    both, mixed = concat_rows([a, b]), concat_rows([a, b, v])
    for stacked in (both, mixed.parts[0]):
        assert stacked.kq is not None
        for i in range(3):
            assert torch.equal(stacked.kq[i], torch.cat([a.kq[i], b.kq[i]]))


def test_long_prompt_chunks_come_to_the_step_where_it_is_faster(monkeypatch):
    """Whole 512-token prompt chunks run on the native step where it was measured faster than the eager BLAS
    step: on AMX machines where the tiles take the 4- and 8-bit layouts (a model of other types, a Q6_K file
    re-blocked, keeps 64-token chunks: the eager step runs it in bf16 on tiles); on x86 without AMX for every
    model of integer codes (the vector kernels take prompt rows 8 at a time), not for F16 weights (one row
    at a time there). `tile_share` and `code_share` count multiply-adds by storage."""
    from support import random_blocks
    cfg = shape_config("tiny", hidden_size=256, head_dim=64, intermediate_size=512, num_layers=2)
    rng = np.random.default_rng(8)
    q4k = _q4k_models(cfg, rng)[0]

    def of_type(fmt: int) -> Any:
        model = random_llama(cfg, seed=3)
        blocks = lambda w: (np.random.default_rng(w.n).standard_normal((w.n, w.k), dtype=np.float32)  # noqa: E731
                            .astype(np.float16).view(np.uint8) if fmt == 1 else random_blocks(fmt, w.n, w.k))
        conv = lambda w: Linear.from_raw(fmt, blocks(w), w.n, w.k)  # noqa: E731
        model.layers = [dataclasses.replace(L, qkv=conv(L.qkv), o=conv(L.o), gate_up=conv(L.gate_up),
                                            down=conv(L.down)) for L in model.layers]
        model.lm_head = conv(model.lm_head)
        return model
    q6k, f16 = of_type(14), of_type(1)   # Q6_K, F16
    six = lambda w: Linear.from_raw(14, random_blocks(14, w.n, w.k), w.n, w.k)  # noqa: E731  (Q6_K)
    dense = random_llama(cfg, seed=3)
    mixed = _q4k_models(cfg, np.random.default_rng(9))[0]   # Q4_K but for Q6_K down rows, as a Q4_K_M file's
    mixed.layers = [dataclasses.replace(L, down=six(L.down)) for L in mixed.layers]
    q4k.lm_head = six(q4k.lm_head)   # a prompt chunk computes the LM head for its output rows only: not counted
    assert tile_share(q4k) == 1.0 and tile_share(q6k) == 0.0 and tile_share(dense) == 0.0
    assert 0.5 < tile_share(mixed) < CpuTeamDecoder.prefill_tile_share   # down: 1/5 of this model's products
    assert code_share(q4k) == code_share(q6k) == code_share(mixed) == 1.0
    assert code_share(f16) == code_share(dense) == 0.0
    lib = load_library()
    amx = bool(lib.ss_amx_active())
    bf16 = bf16_blas_fast(lib)
    x86 = lib.ss_isa().decode() in ("avx2", "avx2-vnni", "avx512", "avx512-vnni")
    for model, tiles_take_it, codes in ((q4k, True, True), (q6k, False, True), (mixed, False, True),
                                        (f16, False, False)):   # (dense fp32 below)
        team = CpuTeamDecoder(model, model.new_kv_cache(16))
        native = tiles_take_it if amx else x86 and codes
        # 16-bit float weights: chunks from 16 tokens run eagerly where that step multiplies bf16 in hardware, else 32
        floats = (CpuTeamDecoder.float_eager_from if bf16 else CpuTeamDecoder.dense_eager_from) - 1
        assert team.prefill_tokens == (512 if native else 64 if codes else floats), (model is f16, amx, x86)
        assert getattr(team, "eager_dense_from_rows", None) == (None if codes else floats + 1)
        exact = CpuTeamDecoder(model, model.new_kv_cache(16), exact=True)
        assert exact.prefill_tokens == 64 and not hasattr(exact, "eager_dense_from_rows")
    team = CpuTeamDecoder(dense, dense.new_kv_cache(16))   # dense fp32 weights: from 32 tokens
    assert team.prefill_tokens == CpuTeamDecoder.dense_eager_from - 1 == team.eager_dense_from_rows - 1
    assert half_float_share(f16) == 1.0 and half_float_share(dense) == half_float_share(q4k) == 0.0
    assert team.eager_blas == ("bf16" if bf16 else "fp32")
    monkeypatch.setenv("SLIPSTREAM_EAGER_BF16", "0")   # the eager step in fp32: F16 chunks from 32 tokens, as dense
    team = CpuTeamDecoder(f16, f16.new_kv_cache(16))
    assert team.eager_blas == "fp32" and team.eager_dense_from_rows == CpuTeamDecoder.dense_eager_from


def test_a_long_chunk_of_a_wide_ffn_runs_on_the_step():
    """A 512-token prompt chunk of a model with an 8192-wide FFN on a 2-thread team: each gate/up task holds its rows'
    outputs (512 x 4096 columns x 2, 16 MB) in a per-thread buffer, not on the stack, where they overflowed a
    thread's 8 MB and killed the process. The fast path's last row is bitwise what chunks of 64 give (rows are
    computed alike whatever shares their step); the exact path matches the eager step."""
    from slipstream.step import prefill_step as build
    cfg = shape_config("tiny", hidden_size=256, head_dim=64, intermediate_size=8192, num_layers=1)
    model = random_llama(cfg, seed=3)
    gen = torch.Generator().manual_seed(0)

    def q8(w: Linear) -> Linear:
        return Linear(w.n, w.k, torch.randint(-127, 128, (w.n, w.k), generator=gen, dtype=torch.int8), Q8_0,
                      (torch.rand(w.n, w.k // 32, generator=gen) * 2e-4).contiguous())
    model.layers = [dataclasses.replace(L, qkv=q8(L.qkv), o=q8(L.o), gate_up=q8(L.gate_up), down=q8(L.down))
                    for L in model.layers]
    tokens = [(7 * i) % 250 + 1 for i in range(512)]

    def native(exact: bool, chunk: int) -> torch.Tensor:
        kv = model.new_kv_cache(600)
        team = CpuTeamDecoder(model, kv, exact=exact, threads=2)
        seq = SequenceKV(kv)
        seq.reserve(520)
        for s in range(0, len(tokens), chunk):
            out = team.forward(build(seq, tokens[s:s + chunk], s, gather=True))
        return out[-1]
    whole = native(False, 512)
    assert torch.isfinite(whole).all() and torch.equal(whole, native(False, 64))
    kv = model.new_kv_cache(600)
    want = model.forward(prefill_step(SequenceKV(kv), tokens), kv)[-1]
    torch.testing.assert_close(native(True, 512), want, rtol=2e-4, atol=2e-4 * want.abs().max().item())


def test_routed_experts_count_by_the_rows_that_run_them():
    """`code_share` and `tile_share` weigh a routed expert's multiply-adds by top-k / experts: a prompt row runs its
    top-k experts only. A MoE layer of F16 attention and 8 quantized experts (top 2) is then mostly F16 per row
    (0.86 coded, under the 0.9 that sends long chunks to the native step), though the experts hold most bytes."""
    from types import SimpleNamespace
    gen = torch.Generator().manual_seed(0)

    def q8(n: int, k: int) -> Linear:
        return Linear(n, k, torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), Q8_0,
                      (torch.rand(n, k // 32, generator=gen) * 1e-3).contiguous())

    def f16(n: int, k: int) -> Linear:
        return Linear.from_raw(1, torch.randn(n, k, generator=gen).half().view(torch.uint8).numpy(), n, k)
    gate_up, down = [q8(512, 256) for _ in range(8)], [q8(256, 256) for _ in range(8)]

    def model(attn: Callable[[int, int], Linear]) -> Any:
        qkv, o = attn(256, 256), attn(256, 256)
        layer = SimpleNamespace(linears=lambda: [qkv, o, *gate_up, *down], experts_gate_up=gate_up, experts_down=down)
        return SimpleNamespace(layers=[layer], cfg=SimpleNamespace(num_experts=8, num_experts_per_tok=2))
    per_row = 2 * (512 + 256) * 256   # two experts' gate/up and down
    half = model(f16)
    assert code_share(half) == pytest.approx(per_row / (per_row + 2 * 256 * 256))
    assert code_share(half) < CpuTeamDecoder.prefill_tile_share < 8 * (512 + 256) / (8 * (512 + 256) + 2 * 256)
    assert tile_share(half) == code_share(half)   # Q8_0 experts: the tiles' layout
    assert code_share(model(q8)) == tile_share(model(q8)) == 1.0
