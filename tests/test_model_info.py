"""`slipstream inspect`, run as a user runs it (the real CLI in a subprocess)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import skip_unless_default_model

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
