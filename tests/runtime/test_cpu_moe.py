"""Qwen2-MoE and Qwen3-MoE on the native CPU step (issue 14) against transformers' own classes and the eager
MoE step, on tiny random configs (those of tests/models/test_qwen_moe.py: 8 experts, top 2, a dense layer
among the MoE ones; Qwen2-MoE with its sigmoid-gated shared expert and q/k/v biases, Qwen3-MoE renormalised
with q/k norms), from a Hugging Face folder (dense fp32 experts) and from a GGUF (packed experts).

The step: a ROUTE task (router, softmax, top k, renormalisation, shared gate; the rows grouped by expert),
EXPERT_GU tiles over the experts active in the step only, SHARED_GU tiles, MOE_DOWN tiles that own hidden
slices and add every active expert's weighted output (and the shared expert's) without races."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from support import check_native_step_against, hf_and_ours  # noqa: E402

from slipstream.kernels.cpu import load_library  # noqa: E402
from slipstream.kv.blocks import SequenceKV  # noqa: E402
from slipstream.models.qwen_moe import QwenMoeModel  # noqa: E402
from slipstream.runtime import cpu_plan  # noqa: E402
from slipstream.runtime.cpu_team import CpuTeamDecoder  # noqa: E402
from slipstream.step import StepBuilder  # noqa: E402
from tests.models.test_qwen_moe import VOCAB, hf_moe, write_gguf  # noqa: E402  (one tiny config, one converter)

pytestmark = pytest.mark.skipif(load_library() is None, reason="native CPU kernels unavailable")

CASES = [(f, fmt) for f in ("qwen2moe", "qwen3moe") for fmt in ("hf", "gguf")]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, QwenMoeModel]:
    family, fmt = request.param
    hf = hf_moe(family, seed=3)

    def write(path):
        Q = gguf.GGMLQuantizationType
        quant = {"token_embd": Q.Q8_0, "attn_q": Q.Q5_0, "ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_0,
                 "ffn_down_exps": Q.Q5_1, "ffn_down_shexp": Q.Q8_0, "ffn_up": Q.Q8_0}
        write_gguf(hf, path, family, quant)
    return hf_and_ours(hf, tmp_path_factory.mktemp(family), fmt, write)


@pytest.mark.parametrize("exact", [True, False])
def test_native_moe_step_matches_transformers(pair, exact):
    """Prompt chunks (1, 3 and 9 rows: up to 8 experts active) then decode rows: the exact path within
    2e-4 of transformers with its greedy tokens, the fast path close."""
    hf, model = pair
    check_native_step_against(hf, model, VOCAB, tokens=14, chunks=(1, 4, 9), exact=exact, num_blocks=8)


def test_native_moe_batch_matches_eager(pair):
    """Three sequences decoded in one step (their rows share experts) against the eager MoE step."""
    _, model = pair
    kv_e, kv_t = model.new_kv_cache(24, block_size=4), model.new_kv_cache(24, block_size=4)
    team = CpuTeamDecoder(model, kv_t, exact=True)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [42]]
    seqs_e, seqs_t = [SequenceKV(kv_e) for _ in prompts], [SequenceKV(kv_t) for _ in prompts]
    for p, se, st in zip(prompts, seqs_e, seqs_t):
        for seq, run in ((se, lambda s: model.forward(s, kv_e)), (st, team.forward)):
            seq.reserve(len(p) + 6)
            b = StepBuilder()
            b.add(seq, p, 0, logits="last")
            run(b.build())
    tokens, pos = [3, 4, 5], [len(p) for p in prompts]
    for _ in range(4):
        outs = []
        for seqs, run in ((seqs_e, lambda s: model.forward(s, kv_e)), (seqs_t, team.forward)):
            b = StepBuilder()
            for s, t, p in zip(seqs, tokens, pos):
                b.add(s, [t], p)
            outs.append(run(b.build()))
        torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=0)
        tokens = outs[0].argmax(-1).tolist()
        pos = [p + 1 for p in pos]


def test_moe_plans_validate():
    moe = cpu_plan.MoeShape(experts=8, topk=2, ffn=64, shared_ffn=32)
    shape = cpu_plan.Shape(3, 64, 4, 2, 16, 96, 96,
                           moe=moe, moe_layers=(0, 2))
    for rows in (1, 3, 9):
        for threads in (1, 2, 8):
            table = cpu_plan.build(shape, rows, threads, argmax=True)
            cpu_plan.validate(table, shape, rows)
            slots = {t[cpu_plan.AUX] for t in table.tolist() if t[cpu_plan.OP] == cpu_plan.EXPERT_GU}
            assert len(slots) == min(8, 2 * rows)
    table = cpu_plan.build(shape, 3, 2, argmax=True)
    broken = table[[t[cpu_plan.OP] != cpu_plan.ROUTE for t in table.tolist()]]
    with pytest.raises(cpu_plan.CpuPlanError):
        cpu_plan.validate(broken, shape, 3)


def test_registry_picks_native_for_moe(pair):
    from slipstream.runtime import registry
    _, model = pair
    assert CpuTeamDecoder.unsupported(model) is None
    assert registry.resolve_runtime("auto", model) == "native"


@pytest.mark.parametrize("family", ["qwen2moe", "qwen3moe"])
def test_engine_on_native_moe_matches_transformers(tmp_path, family):
    """With native MoE (the default), the whole engine (LLM.generate: prompts prefilled as
    native prompt chunks, two sequences decoded together, an fp32 KV cache on the exact path) gives
    transformers' greedy tokens; the fast path (fp16 KV) runs too."""
    from support import gguf_tokenizer

    from slipstream import LLM, SamplingParams
    Q = gguf.GGMLQuantizationType
    path = tmp_path / f"{family}.gguf"
    hf = hf_moe(family, seed=11)
    write_gguf(hf, path, family, {"ffn_gate_exps": Q.Q4_0, "ffn_down_exps": Q.Q8_0}, gguf_tokenizer)
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    llm = LLM(str(path), max_model_len=64, exact=True)
    assert llm.engine.runtime_name == "native" and llm.engine.kv.k.dtype == torch.float32
    for o in llm.generate(["abc!def", "xyz"], params):
        with torch.no_grad():
            ids = torch.tensor([o.prompt_token_ids])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=7,
                              do_sample=False)[0, ids.shape[1]:].tolist()
        assert o.token_ids == ref
    fast = LLM(str(path), max_model_len=64)
    assert fast.engine.runtime_name == "native" and fast.engine.kv.k.dtype == torch.float16
    assert all(len(o.token_ids) == 7 for o in fast.generate(["abc!def", "xyz"], params))
