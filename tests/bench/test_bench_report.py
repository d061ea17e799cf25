"""Report writing on synthetic results: JSON, markdown, PNGs, the terminal table, ratios."""
from __future__ import annotations

import io
import json

from slipstream.bench.cli import main
from slipstream.bench.metrics import RequestResult, headline, summarize
from slipstream.bench.report import compute_ratios, print_table, write_json, write_report
from slipstream.bench.runner import request_record


def point(label, scale, n=6, **extra):
    """A point whose requests have TTFT 0.1*scale s and TPOT 0.01*scale s, 8 tokens each."""
    rs = []
    for i in range(n):
        send = i * 0.5
        ttft, tpot = 0.1 * scale * (1 + i / 10), 0.01 * scale
        rs.append(RequestResult(ok=True, send=send, chunk_times=[send + ttft + k * tpot for k in range(8)],
                                output_tokens=8, prompt_tokens=20, index=i, text="x"))
    rs.append(RequestResult(ok=False, send=0.0, error="HTTP 500: boom", index=n))
    s = summarize(rs, duration=n * 0.5 * scale, slo={"ttft": 150.0})
    return {"label": label, **extra, "summary": s, "headline": headline(s), "warnings": [],
            "requests": [request_record(r, 0.0, True) for r in rs]}


def target(label, scale, role):
    return {"label": label, "role": role, "url": f"http://{label}/v1/chat/completions", "model": "m",
            "server": {"command": ["python", "-m", label], "startup_s": 1.5} if role == "peer" else None,
            "load": {"all": {"machine_busy_cores": 1.9, "other_cores": 0.05}}, "notes": [],
            "scenarios": {
                "short": {"scenario": "short", "mode": "sequential", "config": {"num_prompts": 6},
                          "points": [point("sequential", scale)]},
                "serving": {"scenario": "serving", "mode": "serving", "config": {"dataset": "random"},
                            "points": [point(f"concurrency={c}", scale * c, concurrency=c) for c in (1, 4, 16)]
                            + [point("rate=inf/s", scale, request_rate=float("inf"))]}}}


def results():
    ours, peer = target("ours", 1.0, "target"), target("peer", 2.0, "peer")
    return {"tool": "slipstream bench", "date": "2026-11-22T00:00:00+00:00", "command": "slipstream bench ...",
            "machine": {"cpu": "test cpu", "cores": 2, "memory_gib": 8.0}, "config": {"scenarios": ["short", "serving"],
                                                                                       "slo": {"ttft": 150.0}},
            "targets": [ours, peer], "ratios": compute_ratios(ours, peer), "warnings": ["a warning"]}


def test_ratios():
    r = results()["ratios"]
    assert set(r) == {"short", "serving"}
    assert set(r["serving"]) == {"concurrency=1", "concurrency=4", "concurrency=16", "rate=inf/s"}
    seq = r["short"]["sequential"]
    assert abs(seq["ttft_mean_ms"] - 0.5) < 1e-9          # ours is twice as fast everywhere
    assert abs(seq["tpot_p50_ms"] - 0.5) < 1e-9
    assert abs(seq["output_throughput"] - 2.0) < 1e-9
    assert abs(seq["avg_output_speed_tok_s"] - 2.0) < 1e-9


def test_json_report_and_table(tmp_path):
    res = results()
    p = write_json(tmp_path / "sub" / "r.json", res)
    back = json.loads(p.read_text())                        # strict JSON (inf written as "inf")
    assert back["targets"][0]["scenarios"]["serving"]["points"][3]["request_rate"] == "inf"
    files = write_report(tmp_path / "rep", res)
    names = {f.name for f in files}
    assert names == {"report.md", "short_latency.png", "serving_latency.png", "serving_concurrency.png",
                     "scenarios_overview.png"}
    for f in files:
        assert f.stat().st_size > 1000
        if f.suffix == ".png":
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "rep" / "report.md").read_text()
    for needle in ("# `slipstream bench` report", "test cpu", "## Summary", "## Scenario `serving`", "concurrency=16",
                   "TTFT p99 (ms)", "goodput (req/s)", "0.50x", "2.00x", "![TTFT and TPOT distributions, short](short_latency.png)",
                   "serving_concurrency.png", "HTTP 500: boom", "a warning", "## Definitions"):
        assert needle in md, needle
    buf = io.StringIO()
    print_table(res, file=buf)
    out = buf.getvalue()
    assert "scenario: short" in out and "scenario: serving" in out and "ours/peer" in out and "goodput" in out
    # the same from the saved JSON through the CLI
    assert main(["--from-json", str(p), "--report", str(tmp_path / "rep2")]) == 0
    assert (tmp_path / "rep2" / "serving_concurrency.png").exists()


def test_single_target_report(tmp_path):
    res = results()
    res["targets"] = res["targets"][:1]
    res["ratios"] = {}
    files = write_report(tmp_path, res)
    md = files[0].read_text()
    assert "| short | sequential |" in md and "ours / peer" not in md
