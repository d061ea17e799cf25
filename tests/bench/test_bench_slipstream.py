"""`slipstream bench` as a user runs it, in a subprocess, against a real `slipstream serve` that it
starts itself on the embedded default model: the short scenario and a small serving sweep."""
from __future__ import annotations

import json
import subprocess
import sys

from support import skip_unless_default_model

STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "output_speed_tok_s")


def test_short_and_serving_against_slipstream_serve(tmp_path):
    skip_unless_default_model()
    out, rep = tmp_path / "r.json", tmp_path / "report"
    cmd = [sys.executable, "-m", "slipstream", "bench", "--server", "slipstream", "--server-arg=--max-model-len=1024",
           "--scenario", "short,serving", "--num-prompts", "3", "--max-tokens", "8", "--concurrency", "1,3",
           "--input-len", "48", "--output-len", "8", "--slo", "ttft:20000,tpot:5000",
           "--out", str(out), "--report", str(rep), "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    (t,) = res["targets"]
    assert t["label"] == "slipstream" and t["model"] == "smollm2-135m"
    assert t["tokenizer_endpoint"] == "vllm" and "ignore_eos" in t["fixed_length_fields"]
    short = t["scenarios"]["short"]["points"][0]["summary"]
    assert short["completed"] == 3 and short["failed"] == 0
    assert 0 < short["total_output_tokens"] <= 3 * 8
    points = t["scenarios"]["serving"]["points"]
    assert [pt["label"] for pt in points] == ["concurrency=1", "concurrency=3"]
    for pt in points:
        s = pt["summary"]
        assert s["completed"] == 3 and s["failed"] == 0
        assert s["total_output_tokens"] == 3 * 8            # ignore_eos honoured: exact lengths
        assert s["total_input_tokens"] == 3 * 48            # prompts cut to --input-len by /tokenize
        for k in STATS:
            assert s[k]["n"] > 0 and 0 < s[k]["p50"] <= s[k]["p99"]
        assert 0 < s["ttft_ms"]["mean"] < s["e2el_ms"]["mean"]   # no speed asserted: the machine may be loaded
        assert s["output_throughput"] > 0
        assert s["good_requests"] == 3
        for r in pt["requests"]:
            assert r["output_tokens_source"] == "usage" and r["ok"]
    assert (rep / "report.md").read_text().count("concurrency=") >= 2
    assert (rep / "serving_concurrency.png").read_bytes()[:4] == b"\x89PNG"
