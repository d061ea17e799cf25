"""Megakernel plans (`runtime/plan/`): the static validator on real shapes and on broken plans, save and
load, and the torch VM (`runtime/vm.py`) against the eager step on a tiny random model."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from slipstream.config import ModelConfig
from slipstream.kv.blocks import SequenceKV
from slipstream.models.random_init import random_llama, shape_config
from slipstream.runtime.plan import (
    AUX,
    LAYER,
    OP,
    SIG_EV,
    T0,
    T1,
    WAIT_COUNT,
    WAIT_EV,
    Op,
    Plan,
    PlanError,
    TileConfig,
    WeightLayout,
    compile_plan,
    fill_inputs,
    new_buffers,
    pack_weights,
    supports,
    validate,
)
from slipstream.runtime.plan.validator import _check_data_flow
from slipstream.runtime.vm import PlanDecoder, run_plan
from slipstream.step import StepInput, decode_step, prefill_step
from slipstream.weights.quant import Linear

SMOLLM2_135M = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, intermediate_size=1536, rope_theta=100000.0,
                           tie_word_embeddings=True)
# small tiles on the tiny model: several tiles per output, several attention splits per sequence
SMALL_TILES = TileConfig(embed=24, o=16, gate_up=48, down=16, lm_head=100, partition=16)


def _config(name: str) -> ModelConfig:
    return SMOLLM2_135M if name == "smollm2-135m" else shape_config(name)


def _plan(name: str = "tiny", batch: int = 4, max_context: int = 64, block_size: int = 4,
          tiles: TileConfig = SMALL_TILES) -> Plan:
    cfg = _config(name)
    return compile_plan(cfg, batch, max_context, block_size, WeightLayout.for_config(cfg, cfg.tie_word_embeddings),
                        tiles)


def _rows(plan: Plan, op: Op, layer: int | None = None) -> list[int]:
    """Indices of the tasks of `op` (in `layer`), in order."""
    t = plan.tasks
    mask = t[:, OP] == int(op)
    if layer is not None:
        mask &= t[:, LAYER] == layer
    return mask.nonzero().flatten().tolist()


def compile_like(plan: Plan, tasks: torch.Tensor) -> Plan:
    """The same plan with another task table (its metadata untouched, as a hand edit would leave it)."""
    return dataclasses.replace(plan, tasks=tasks)


# -- the validator ----------------------------------------------------------------------------------
@pytest.mark.parametrize("max_context", [512, 2048])
@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "dense-1B", "dense-8B"])
def test_plans_for_real_shapes_validate(name, max_context):
    cfg = _config(name)
    layout = WeightLayout.for_config(cfg, cfg.tie_word_embeddings)
    tables = []
    for batch in (1, 4, 8):
        plan = compile_plan(cfg, batch, max_context, 16, layout)
        validate(plan)
        tables.append(plan.tasks)
        assert plan.acts.total == batch * (cfg.hidden_size + 2 * cfg.num_heads * cfg.head_dim
                                           + cfg.num_heads * plan.splits * (cfg.head_dim + 2)
                                           + cfg.intermediate_size + cfg.vocab_size + 2 * plan.lm_tiles
                                           + (2 * cfg.num_layers + 1) * plan.norm_tiles)
    assert all(torch.equal(t, tables[0]) for t in tables)   # the table does not depend on the batch


def test_plan_order_and_events():
    plan = _plan()
    t = plan.tasks
    assert t.shape[1] == 10 and t.dtype == torch.int64
    assert t[0, OP] == Op.EMBED and t[-1, OP] == Op.ARGMAX
    H, KVH, G = plan.num_heads, plan.num_kv_heads, plan.group
    half = plan.head_dim // 2     # QKV tasks: rotation pairs [T0, T1) of one head (one task per head here)
    heads = t[_rows(plan, Op.QKV_ROPE, 0), T0].tolist()
    assert heads == [h * half for g in range(KVH) for h in [*range(g * G, g * G + G), H + g, H + KVH + g]]
    splits = t[_rows(plan, Op.ATTN_SPLIT, 1)][:, [T0, T1]].tolist()
    assert splits == [[g, s] for g in range(KVH) for s in range(plan.splits)]
    o = t[_rows(plan, Op.O_PROJ, 0)]
    assert o[:, WAIT_EV].unique().tolist() == [plan.event_names.index("attn_done[0]")]
    assert o[:, WAIT_COUNT].unique().tolist() == [KVH]
    assert plan.event_counts[plan.event_names.index("qkv_done[1][0]")] == G + 2
    assert plan.event_names[-2:] == ["logits_done", "step_done"]


def _broken(kind: str) -> Plan:
    plan = _plan()
    t = plan.tasks.clone()
    ev = plan.event_names.index
    if kind == "removed wait":
        i = _rows(plan, Op.ATTN_SPLIT, 1)[0]
        t[i, WAIT_EV], t[i, WAIT_COUNT] = -1, 0
    elif kind == "wrong wait count":
        i = _rows(plan, Op.O_PROJ, 0)[1]
        t[i, WAIT_COUNT] -= 1
    elif kind == "moved before producer":
        i, first_o = _rows(plan, Op.GATE_UP, 0)[2], _rows(plan, Op.O_PROJ, 0)[0]
        order = list(range(len(t)))
        order.remove(i)
        order.insert(first_o, i)
        t = t[order]
    elif kind == "missing tile":
        drop = _rows(plan, Op.O_PROJ, 1)[1]
        t = torch.cat([t[:drop], t[drop + 1:]])
    elif kind == "duplicated tile":
        dup = _rows(plan, Op.DOWN, 0)[2]
        t = torch.cat([t[:dup + 1], t[dup:]])
    elif kind == "wrong layer":
        for i in _rows(plan, Op.DOWN, 1):
            t[i, WAIT_EV] = ev("gu_done[0]")
    elif kind == "reduce row":   # plan version 2's ATTN_REDUCE task: the last split merges since version 3
        at = _rows(plan, Op.O_PROJ, 1)[0]
        red = torch.tensor([[int(Op.ATTN_REDUCE), 1, 0, 1, ev("split_done[1][0]"), plan.splits,
                             ev("attn_done[1]"), -1, -1, 0]])
        t = torch.cat([t[:at], red, t[at:]])
    elif kind == "split of another group":
        t[_rows(plan, Op.ATTN_SPLIT, 1)[plan.splits], SIG_EV] = ev("split_done[1][0]")
    elif kind == "merge event":
        t[_rows(plan, Op.ATTN_SPLIT, 1)[1], AUX] = ev("o_done[1]")
    return compile_like(plan, t)


@pytest.mark.parametrize("kind, message", [
    ("removed wait", r"ATTN_SPLIT layer 1 \[0, 0\)\) reads q\[0:16\] before its producer task \d+ \(QKV_ROPE layer 1"),
    ("wrong wait count", r"O_PROJ layer 0 \[16, 32\)\) waits for 1 signals of event 'attn_done\[0\]', which "
                         r"receives 2"),
    ("moved before producer", r"GATE_UP layer 0 \[96, 128\)\) waits on event 'o_done\[0\]' but its producer .*"
                              r"O_PROJ layer 0 .* is not earlier"),
    ("missing tile", r"O_PROJ of layer 1: \[16, 32\) of \[0, 64\) is not covered"),
    ("duplicated tile", r"DOWN of layer 0: \[32, 48\) covered twice"),
    ("wrong layer", r"DOWN layer 1 \[0, 16\)\) reads act\[0:128\] before its producer task \d+ \(GATE_UP layer 1"),
    ("reduce row", r"ATTN_REDUCE layer 1 \[0, 1\)\): no ATTN_REDUCE row since plan version 3"),
    ("split of another group", r"ATTN_SPLIT layer 1 \[1, 0\)\) signals event 'split_done\[1\]\[0\]' of the splits "
                               r"of layer 1 kv head 0"),
    ("merge event", r"ATTN_SPLIT layer 1 \[0, 1\)\) signals event 'split_done\[1\]\[0\]' of the splits of layer 1 "
                    r"kv head 0 \(merge event \d+\)"),
])
def test_broken_plans_are_rejected(kind, message):
    with pytest.raises(PlanError, match=message):
        validate(_broken(kind))


def test_validator_follows_event_chains():
    """A task that waits on an event too early in the chain reads the residual stream before the
    previous layer's DOWN tiles have written it."""
    plan = _plan()
    t = plan.tasks.clone()
    i = _rows(plan, Op.QKV_ROPE, 1)[0]
    t[i, WAIT_EV] = plan.event_names.index("attn_done[0]")
    t[i, WAIT_COUNT] = plan.event_counts[t[i, WAIT_EV]]
    with pytest.raises(PlanError, match=r"QKV_ROPE layer 1 .* reads x\[0:64\] before its producer .*DOWN layer 0"):
        validate(compile_like(plan, t))


def test_data_flow_catches_write_after_read():
    """q is reused by every layer: a stray split that reads it unordered with the QKV task that next
    overwrites it is a race (checked on the data flow alone: coverage would reject the stray first)."""
    plan = _plan()
    t = plan.tasks
    stray = t[_rows(plan, Op.ATTN_SPLIT, 1)[0]].clone()
    stray[WAIT_EV], stray[WAIT_COUNT] = plan.event_names.index("embed_done"), plan.event_counts[0]
    at = _rows(plan, Op.QKV_ROPE, 0)[0]
    rows = torch.cat([t[:at], stray[None], t[at:]]).tolist()
    with pytest.raises(PlanError, match=r"task 4 \(QKV_ROPE layer 0 \[0, 8\)\) writes q\[0:8\] while task 3 "
                                        r"\(ATTN_SPLIT layer 1 \[0, 0\)\), which reads it, may still be running"):
        _check_data_flow(plan, rows)


def test_plan_save_load_round_trip(tmp_path):
    plan = _plan("smollm2-135m", batch=8, max_context=2048, block_size=16, tiles=TileConfig())
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert torch.equal(loaded.tasks, plan.tasks) and loaded.acts == plan.acts and loaded.ints == plan.ints
    assert loaded.weights == plan.weights and loaded.tiles == plan.tiles
    validate(loaded)
    doc = json.loads(path.read_text())
    doc["tasks"][5][T1] += 1
    path.write_text(json.dumps(doc))
    assert Plan.load(path) != plan
    # plans saved before QKV tasks covered rotation pairs (format 1) or with ATTN_REDUCE rows (format 2)
    # are refused, not misread
    for old in (1, 2):
        doc["version"] = old
        path.write_text(json.dumps(doc))
        assert Plan.file_version(path) == old
        with pytest.raises(PlanError, match="recompile"):
            Plan.load(path)


# -- weights --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_pack_weights_layout(tied):
    model = random_llama(shape_config("tiny", tie_word_embeddings=tied))
    W, layout = pack_weights(model)
    cfg = model.cfg
    assert layout == WeightLayout.for_config(cfg, tied) and W.numel() == layout.total
    assert (layout.embed == layout.lm_head) == tied
    Hd = cfg.hidden_size
    L1 = layout.layers[1]
    gu = W[L1["gate_up"]:L1["gate_up"] + 2 * cfg.intermediate_size * Hd].view(-1, Hd)
    assert torch.equal(gu, model.layers[1].gate_up.dequantize())
    assert torch.equal(W[L1["ffn_norm"]:L1["ffn_norm"] + Hd], model.layers[1].ffn_norm)
    assert torch.equal(W[layout.embed:layout.embed + cfg.vocab_size * Hd].view(-1, Hd), model.embed.dequantize())
    assert torch.equal(W[layout.norm:layout.norm + Hd], model.norm)
    assert layout.layers[0]["attn_norm"] == 0
    assert layout.layers[1]["attn_norm"] == layout.layers[0]["down"] + Hd * cfg.intermediate_size


def test_supports():
    assert supports(random_llama(shape_config("tiny"))) is None
    model = random_llama(shape_config("tiny"))
    qkv = model.layers[1].qkv
    model.layers[1].qkv = Linear.dense(qkv.data, torch.zeros(qkv.n))
    assert "bias" in supports(model)
    model = random_llama(shape_config("tiny"))
    model.layers[0].q_norm = torch.ones(model.cfg.head_dim)
    assert "norm" in supports(model)
    model = random_llama(shape_config("tiny"))
    model.inv_freq = model.inv_freq[:4]
    assert "rotary" in supports(model)
    assert "power of two" in supports(random_llama(shape_config("tiny", head_dim=24)))
    assert "Llama" in supports(object())


# -- the VM against the eager step ----------------------------------------------------------------
def _prefill(model, kv, seq: SequenceKV, prompt: list[int]) -> torch.Tensor:
    seq.reserve(len(prompt))
    return model.forward(prefill_step(seq, prompt), kv)


def _decode_step(seqs: list[SequenceKV], tokens: list[int], positions: list[int]) -> StepInput:
    for s, q in zip(seqs, positions):
        s.reserve(q + 1)
    return decode_step(seqs, tokens, positions)


@pytest.mark.parametrize("prompt_lens,qkv_parts", [([14], 1), ([3, 14, 30], 1), ([3, 14, 30], 4)])
def test_vm_matches_eager(prompt_lens, qkv_parts):
    """Contexts cross KV blocks (size 4) and attention partitions (16); the VM's cache gets a different,
    interleaved block layout from the eager one's, so its block tables differ and are not contiguous.
    With `qkv_parts` 4 each head's QKV product and RoPE run as 4 tasks of 2 rotation pairs."""
    model = random_llama(shape_config("tiny"), seed=1)
    kv_e, kv_p = model.new_kv_cache(64, 4), model.new_kv_cache(64, 4)
    kv_p.allocator.allocate(3)
    decoder = PlanDecoder(model, kv_p, max_batch=4, max_context=64,
                          tiles=dataclasses.replace(SMALL_TILES, qkv_parts=qkv_parts))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    seqs_e, seqs_p = [SequenceKV(kv_e) for _ in prompts], [SequenceKV(kv_p) for _ in prompts]
    tokens = []
    for p, se, sp in zip(prompts, seqs_e, seqs_p):
        tokens.append(int(_prefill(model, kv_e, se, p).argmax()))
        _prefill(model, kv_p, sp, p)
    kv_p.allocator.allocate(1)   # a foreign block: the next block of every sequence is not adjacent
    positions = list(prompt_lens)
    for _ in range(5):
        le = model.forward(_decode_step(seqs_e, tokens, positions), kv_e)
        lp = decoder.forward(_decode_step(seqs_p, tokens, positions))
        assert (le - lp).abs().max().item() < 1e-4
        tokens = le.argmax(-1).tolist()
        assert decoder.next_tokens.tolist() == tokens
        positions = [q + 1 for q in positions]
    plan = decoder.plan_for(len(prompts))[0]
    assert plan.batch == (1 if len(prompts) == 1 else 4) and plan.splits == 4
    assert any(not isinstance(s.read_slots(q), tuple) for s, q in zip(seqs_p, positions))


def test_fill_inputs_pads_rows():
    model = random_llama(shape_config("tiny"))
    kv = model.new_kv_cache(16, 4)
    seq = SequenceKV(kv)
    plan = _plan(batch=4)
    seq.reserve(5)
    step = _decode_step([seq], [7], [4])
    _, I, _ = new_buffers(plan)
    fill_inputs(plan, I, step, 4)
    n = plan.ints
    assert I[n.tokens:n.tokens + 4].tolist() == [7, 0, 0, 0]
    assert I[n.write_slots:n.write_slots + 4].tolist() == [int(seq.slots(4, 5)), -1, -1, -1]
    assert I[n.context_lens:n.context_lens + 4].tolist() == [5, 1, 1, 1]
    assert I[n.block_tables:n.block_tables + 2].tolist() == seq.block_table[:2]
    with pytest.raises(ValueError, match="block size"):
        fill_inputs(plan, I, step, 8)


def test_vm_checks_waits():
    model = random_llama(shape_config("tiny"))
    W, layout = pack_weights(model)
    plan = _plan()
    kv = model.new_kv_cache(16, 4)
    A, I, E = new_buffers(plan)
    I[plan.ints.context_lens:plan.ints.context_lens + plan.batch] = 1
    I[plan.ints.write_slots:plan.ints.write_slots + plan.batch] = -1
    run_plan(plan, W, A, I, kv.k, kv.v, model.inv_freq, E)    # the intact plan runs
    assert E.tolist() == plan.event_counts
    t = plan.tasks.clone()
    i = _rows(plan, Op.O_PROJ, 1)[0]
    order = list(range(len(t)))
    order.remove(i)
    order.insert(_rows(plan, Op.ATTN_SPLIT, 1)[0], i)   # before the splits (their last ones signal attn_done[1])
    with pytest.raises(PlanError, match=r"O_PROJ layer 1 .* waits for 2 signals of event 'attn_done\[1\]' "
                                        r"but only 0 arrived"):
        run_plan(compile_like(plan, t[order]), W, A, I, kv.k, kv.v, model.inv_freq)
