"""benchmarks/gpu_decode.py end to end in --tiny mode (CPU, float32, Triton's interpreter): the
plumbing of every path, the JSON's fields, and the token checks (graph = eager, HF = eager)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import importlib.util

import pytest

# find_spec, not importorskip: importing triton here would fix its mode for the whole session
if importlib.util.find_spec("triton") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs triton and transformers", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_decode.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_decode") / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--steps", "3", "--runs", "1", "--warmup", "1",
           "--batches", "1,2", "--out", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads(out.read_text())


def test_json_has_the_provenance(run):
    _, doc = run
    for key in ("gpu", "versions", "commit", "command", "date", "bandwidth", "results", "settings"):
        assert key in doc
    assert doc["status"] == "done" and doc["errors"] == []
    assert doc["gpu"]["name"] == "cpu" and "driver_version" in doc["gpu"]
    for mod in ("torch", "triton", "transformers", "cuda"):
        assert mod in doc["versions"]
    assert "--tiny" in doc["command"]
    bw = doc["bandwidth"]
    assert bw["bytes_per_s"] > 0 and len(bw["times_s"]) >= 3


def test_every_path_measured_with_roofline(run):
    _, doc = run
    assert [(e["shape"], e["batch"]) for e in doc["results"]] == [("tiny", 1), ("tiny", 2)]
    for e in doc["results"]:
        roof = e["roofline"]
        assert roof["bytes_per_step"] == roof["weight_bytes"] + roof["embed_row_bytes"] + roof["kv_bytes"]
        assert roof["kv_bytes"] == e["batch"] * 24 * 2 * 2 * 2 * 16 * 4   # B x ctx x layers x K,V x KVH x D x f32
        assert roof["tok_s"] > 0
        for name in ("hf", "eager", "graph"):
            p = e["paths"][name]
            assert p["status"] == "ok", p
            assert p["tok_s"] > 0 and p["pct_roofline"] > 0 and p["bytes_per_step"] == roof["bytes_per_step"]
            assert len(p["step_times_s"]) == 1 and p["median_step_s"] > 0
            assert len(p["tokens"]) == 3 and all(len(t) == e["batch"] for t in p["tokens"])
            assert p["repeatable"]
        assert "compile" not in e["paths"]          # --tiny skips torch.compile unless asked
        mk = e["paths"]["megakernel"]
        assert mk["status"]   # measured, or why not (unavailable / error)
        if mk["status"] == "ok":   # its error word checked after every timed run, not once
            assert mk["checked_runs"] == mk["runs"] == 1


def test_graph_tokens_equal_eager_and_hf_agrees(run):
    _, doc = run
    for e in doc["results"]:
        P, C = e["paths"], e["checks"]
        assert P["graph"]["tokens"] == P["eager"]["tokens"]
        g = C["graph_vs_eager"]
        assert g["free_running"]["all_match"] and g["free_running"]["matching_steps"] == 3
        assert g["forced"]["token_mismatches"] == 0
        assert g["first_step"]["max_abs_logit_diff"] < 1e-4
        # HF and Slipstream run the same float32 weights: the mapping (fused QKV, gate/up, RoPE) holds
        h = C["hf_vs_eager"]
        assert h["free_running"]["all_match"] and h["first_step"]["max_abs_logit_diff"] < 1e-4


def test_table_printed(run):
    proc, _ = run
    assert "graph=eager" in proc.stdout and "hf tok/s" in proc.stdout
    assert any(line.split()[:2] == ["tiny", "1"] for line in proc.stdout.splitlines())
