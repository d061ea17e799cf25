"""`--tensor-parallel 2` with gloo on the CPU: a tiny Llama, Qwen3, Gemma 3, Gemma 2, Phi-3 (LongRoPE,
partial rotary), DeepSeek-V3 (MLA, MoE), DeepSeek-V3.2 (MLA with DSA's indexer) and GLM-4.5 MoE (GQA)
split over two processes give the greedy tokens of the unsplit model through the engine (rank 0
schedules, rank 1 follows its step descriptions) and logits within 1e-4."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tp_workers

MODELS = ["llama", "qwen3", "gemma3", "gemma2", "phi3", "deepseek_v3", "deepseek_v32", "glm4_moe"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    d = tmp_path_factory.mktemp("tp")
    out = d / "results.pt"
    mp.start_processes(tp_workers.run, args=(2, str(d / "init"), MODELS, str(out)), nprocs=2, join=True,
                       start_method="spawn")
    return torch.load(out)


@pytest.mark.parametrize("name", MODELS)
def test_tp2_equals_tp1(results: dict, name: str):
    r = results[name]
    assert r["tp_tokens"] == r["ref_tokens"]
    assert all(len(t) == 16 for t in r["tp_tokens"])
    torch.testing.assert_close(r["tp_logits"], r["ref_logits"], atol=ATOL, rtol=0)


def test_models_are_not_degenerate(results: dict):
    """Guards the comparison: each model's best token varies over the prompt's positions (its logits
    are not flat), and the two prompts' greedy answers differ."""
    for name in MODELS:
        best = results[name]["ref_logits"].argmax(-1).tolist()
        assert len(set(best)) > 5, (name, best)
        assert results[name]["ref_tokens"][0] != results[name]["ref_tokens"][1]


def test_indivisible_heads_are_refused():
    from slipstream.distributed.tensor_parallel import _span
    from slipstream.errors import SlipstreamError

    with pytest.raises(SlipstreamError, match="does not divide"):
        _span(6, 4, 0, "attention heads")
    assert _span(8, 2, 1, "x") == (4, 8)


def test_cli_generate_with_tensor_parallel_2(tmp_path):
    """`slipstream generate FOLDER --tensor-parallel 2` (rank 0 here, rank 1 a spawned process) gives the
    greedy tokens of the same command without it (eager runtime, one process)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    folder = tmp_path / "tiny-llama"
    tp_workers.write_hf_llama(folder)
    prompt = " ".join(f"w{(7 * i + 3) % tp_workers.VOCAB}" for i in range(12))

    def generate(*extra: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "slipstream", "generate", str(folder), "-p", prompt,
                               "--max-tokens", "10", "--ignore-eos", "--json", *extra],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "SLIPSTREAM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    tp, one = generate("--tensor-parallel", "2"), generate("--runtime", "eager")
    assert tp["token_ids"] == one["token_ids"] and len(tp["token_ids"]) == 10
    assert len(set(tp["token_ids"])) > 1
