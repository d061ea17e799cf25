"""The metric maths on hand-made chunk timelines (binary-exact times, so equalities are exact)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from slipstream.bench.metrics import (RequestResult, headline, meets_slo, parse_slo, percentile, ratio,
                                      request_metrics, stats, summarize)


def req(send, chunks, out, ok=True, prompt=10, **kw):
    return RequestResult(ok=ok, send=send, chunk_times=list(chunks), output_tokens=out, prompt_tokens=prompt, **kw)


# request A: sent at 0, content chunks at 0.25, 0.375, 0.5, 0.75; 5 tokens (one chunk carried two)
A = dict(send=0.0, chunks=[0.25, 0.375, 0.5, 0.75], out=5)
# request B: sent at 0.5, chunks at 1.0, 1.25, 1.5; 3 tokens
B = dict(send=0.5, chunks=[1.0, 1.25, 1.5], out=3)


def test_percentile_numpy_linear_by_hand():
    xs = [4.0, 1.0, 3.0, 2.0]              # unsorted on purpose
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5       # h = 1.5
    assert percentile(xs, 25) == 1.75      # h = 0.75
    assert percentile(xs, 90) == pytest.approx(3.7, abs=1e-12)    # h = 2.7
    assert percentile(xs, 99) == pytest.approx(3.97, abs=1e-12)   # h = 2.97
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)


def test_stats():
    s = stats([250.0, 500.0])
    assert s == {"n": 2, "mean": 375.0, "std": 125.0, "min": 250.0, "p50": 375.0, "p90": 475.0,
                 "p99": 497.5, "max": 500.0}
    assert stats([])["mean"] is None and stats([])["n"] == 0


def test_request_metrics_exact():
    m = request_metrics(req(**A))
    assert m.ttft == 0.25
    assert m.e2e == 0.75
    assert m.tpot == 0.125            # (0.75 - 0.25) / (5 - 1): tokens from usage, not the 4 chunks
    assert m.itl == [0.125, 0.125, 0.25]
    assert m.output_speed == 8.0      # (5 - 1) / 0.5
    m = request_metrics(req(**B))
    assert (m.ttft, m.e2e, m.tpot, m.itl, m.output_speed) == (0.5, 1.0, 0.25, [0.25, 0.25], 4.0)


def test_request_metrics_edge_cases():
    one = request_metrics(req(0.0, [0.5], 1))
    assert one.ttft == 0.5 and one.e2e == 0.5 and one.tpot is None and one.itl == [] and one.output_speed is None
    failed = request_metrics(req(0.0, [], None, ok=False, error="HTTP 500"))
    assert failed.ttft is None and failed.tpot is None


def test_summarize_exact():
    rs = [req(**A), req(**B), req(0.0, [], None, ok=False, error="HTTP 500: boom")]
    s = summarize(rs, duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["total_output_tokens"] == 8 and s["total_input_tokens"] == 20
    assert s["output_throughput"] == 4.0
    assert s["request_throughput"] == 1.0
    assert s["total_token_throughput"] == 14.0
    assert s["ttft_ms"]["mean"] == 375.0 and s["ttft_ms"]["p50"] == 375.0 and s["ttft_ms"]["p90"] == 475.0
    assert s["ttft_ms"]["p99"] == 497.5
    assert s["tpot_ms"]["mean"] == 187.5 and s["tpot_ms"]["min"] == 125.0 and s["tpot_ms"]["max"] == 250.0
    assert s["itl_ms"]["n"] == 5 and s["itl_ms"]["mean"] == 200.0 and s["itl_ms"]["p50"] == 250.0
    assert s["e2el_ms"]["mean"] == 875.0
    assert s["output_speed_tok_s"]["mean"] == 6.0
    assert "request_goodput" not in s
    h = headline(s)
    assert h == {"avg_output_speed_tok_s": 6.0, "mean_ttft_ms": 375.0, "mean_e2el_s": 0.875, "total_time_s": 2.0,
                 "output_throughput": 4.0, "completed": 2, "failed": 1}


@pytest.mark.parametrize("slo,good", [
    ("ttft:300", 1),              # A (250 ms) only
    ("tpot:200", 1),              # A (125 ms) only
    ("ttft:600,tpot:300", 2),     # both
    ("ttft:250,tpot:125", 1),     # limits are inclusive
    ("e2el:800", 1),              # A (750 ms) only
    ("ttft:100", 0),
])
def test_goodput(slo, good):
    s = summarize([req(**A), req(**B), req(0.0, [], None, ok=False)], duration=2.0, slo=parse_slo(slo))
    assert s["good_requests"] == good
    assert s["request_goodput"] == good / 2.0


def test_single_token_request_meets_tpot_slo():
    m = request_metrics(req(0.0, [0.25], 1))
    assert meets_slo(m, {"tpot": 1.0})
    assert not meets_slo(m, {"ttft": 100.0})


def test_parse_slo():
    assert parse_slo("ttft:200, tpot:50") == {"ttft": 200.0, "tpot": 50.0}
    assert parse_slo(None) == {}
    for bad in ("ttft", "foo:1", "ttft:x", "tpot:0"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_ratio():
    assert ratio(10.0, 4.0) == 2.5
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None
