"""The GPU runtimes the way a user drives them: `slipstream compile` a (tiny, random) Hugging Face
model, then `slipstream generate ARTIFACT --runtime graph|megakernel` in a subprocess, whose greedy
tokens must equal `--runtime eager`'s. On a CPU the kernels run under Triton's interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from support import skip_unless_default_model

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    skip_unless_default_model()
    transformers = pytest.importorskip("transformers")
    from slipstream.weights import load_model

    tok = load_model(None).tokenizer
    folder = tmp_path_factory.mktemp("tiny") / "hf"
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": tok.bos_token, "eos_token": tok.eos_token}))
    out = folder.parent / "art"
    p = subprocess.run([sys.executable, "-m", "slipstream", "compile", str(folder), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    manifest = json.loads((out / "slipstream-artifact.json").read_text())
    assert manifest["kernels"]["plan_context"] == 256 and len(manifest["kernels"]["plans"]) == 4
    return out


def _generate(artifact, runtime: str) -> dict:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, "-m", "slipstream", "generate", str(artifact), "-p", "The sky is",
                        "--max-tokens", "5", "--ignore-eos", "--temperature", "0", "--json", "--runtime", runtime],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_graph_and_megakernel_generate_the_eager_tokens(artifact):
    eager = _generate(artifact, "eager")
    assert len(eager["token_ids"]) == 5
    for runtime in ("graph", "megakernel"):
        out = _generate(artifact, runtime)
        assert out["runtime"] == runtime
        assert out["token_ids"] == eager["token_ids"], runtime


def test_without_a_gpu_or_the_interpreter_the_error_is_clear(artifact):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "slipstream", "generate", str(artifact), "-p", "Hi", "--max-tokens", "2",
                        "--runtime", "megakernel"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0
    assert "needs a CUDA GPU" in p.stderr and "Traceback" not in p.stderr
