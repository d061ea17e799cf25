"""`slipstream inspect`, run as a user runs it (the real CLI in a subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import gguf_tokenizer, skip_unless_default_model

from slipstream.kernels.cpu import native_available


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slipstream", "inspect", *args], capture_output=True, text=True,
                          timeout=300)


def test_inspect_the_default_model():
    skip_unless_default_model()
    proc = inspect("--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["format"] == "gguf" and r["architecture"] == "llama"
    assert 130e6 < r["parameters"] < 140e6                      # SmolLM2-135M
    assert set(r["types"]) == {"Q4_1", "Q8_0", "F32"}
    assert sum(t["tensors"] for t in r["types"].values()) == 272  # 30 layers x 9 + embedding + final norm
    assert r["context_length"] == 8192
    assert "tokenizer.chat_template" in r["chat_template"]
    assert r["runtime"] == ("native" if native_available() else "eager")
    assert r["runtimes"]["eager"] == "ok" and set(r["runtimes"]) >= {"eager", "native", "graph", "megakernel"}
    assert r["load_s"] > 0 and r["resident_bytes"] > 0
    # issue 14: resident after load <= 1.3x the file (1.44x with gguf-py's reader and a torch-made
    # tokenizer vocabulary; 1.21x when this was written)
    assert r["resident_bytes"] <= 1.3 * r["file_bytes"], (r["resident_bytes"], r["file_bytes"])
    text = inspect()
    assert text.returncode == 0 and "Q4_1" in text.stdout and "native" in text.stdout


@pytest.mark.parametrize("damage", ["truncated", "bad_version"])
def test_a_damaged_file_is_one_error_line(tmp_path: Path, damage: str):
    skip_unless_default_model()
    from slipstream.weights import default_model_path
    data = bytearray(default_model_path().read_bytes())
    bad = tmp_path / f"{damage}.gguf"
    if damage == "truncated":
        data = data[: len(data) * 2 // 3]
    else:
        data[4:8] = (99).to_bytes(4, "little")
    bad.write_bytes(bytes(data))
    proc = inspect(str(bad))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(bad) in lines[0], proc.stderr


# -- the families beyond Llama, on tiny GGUFs written as llama.cpp's converter writes them ---------------

def _family_module(name: str):
    """A tests/models module (its transformers model and GGUF writer), loaded by path."""
    import importlib.util
    path = Path(__file__).parent / "models" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_inspect_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_family(family: str, path: Path) -> None:
    pytest.importorskip("transformers")
    if family == "gemma2":
        m = _family_module("test_gemma2")
        m.write_gguf(m.hf_gemma2(), path, {}, gguf_tokenizer)
    elif family == "phi3":
        m = _family_module("test_phi3")
        m.write_gguf(m.hf_phi3(0.75, True), path, {}, gguf_tokenizer)
    else:
        m = _family_module("test_qwen_moe")
        import gguf
        m.write_gguf(m.hf_moe(family), path, family, {"ffn_up_exps": gguf.GGMLQuantizationType.Q8_0}, gguf_tokenizer)


@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen2moe", "qwen3moe"])
def test_inspect_each_family(tmp_path: Path, family: str):
    """inspect describes the file and which runtime runs it (the native CPU step, MoE families included),
    with each other runtime's reason."""
    from slipstream.model_info import inspect_model, render
    path = tmp_path / f"{family}.gguf"
    _write_family(family, path)
    r = inspect_model(path)
    assert r.format == "gguf" and r.architecture == family and r.parameters > 0
    assert r.runtimes["eager"] == "ok" and set(r.runtimes) >= {"eager", "native", "graph", "megakernel"}
    picked = "native"
    assert r.runtime == picked and r.runtimes[picked] == "ok"
    assert all(r.runtimes[n] != "ok" for n in ("native", "graph", "megakernel") if n != picked)
    if family.endswith("moe"):
        assert "Q8_0" in r.types
    text = render(r)
    assert family in text and picked in text


def test_inspect_cli_on_a_family_file(tmp_path: Path):
    path = tmp_path / "qwen3moe.gguf"
    _write_family("qwen3moe", path)
    proc = inspect(str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["architecture"] == "qwen3moe" and r["runtime"] == "native"


def test_inspect_marks_the_types_re_encoded_at_load(tmp_path: Path):
    """IQ3_S weights become the IQ4 kernels' 4-bit planes at load (4.25 bits a weight), IQ2_XS ones the per-16 planes
    (4.56): `inspect` says so; with SLIPSTREAM_IQ_IN_PLACE=1 they stay the file's blocks and the note goes."""
    gguf = pytest.importorskip("gguf")
    from support import tiny_llama_gguf
    QT = gguf.GGMLQuantizationType
    tiny_llama_gguf(tmp_path / "iq.gguf", {"blk.0.ffn_down": QT.IQ3_S, "blk.0.ffn_up": QT.IQ2_XS}, size=0.1)
    out = inspect(str(tmp_path / "iq.gguf")).stdout.splitlines()
    line = next(x for x in out if x.strip().startswith("IQ3_S"))
    assert "re-encoded at load into 4-bit planes (4.25 bits a weight)" in line
    line = next(x for x in out if x.strip().startswith("IQ2_XS"))
    assert "re-encoded at load into 4-bit planes (4.56 bits a weight)" in line
    env = {**os.environ, "SLIPSTREAM_IQ_IN_PLACE": "1"}
    kept = subprocess.run([sys.executable, "-m", "slipstream", "inspect", str(tmp_path / "iq.gguf")],
                          capture_output=True, text=True, timeout=300, env=env)
    line = next(x for x in kept.stdout.splitlines() if x.strip().startswith("IQ3_S"))
    assert "re-encoded" not in line, kept.stdout + kept.stderr
