"""The benchmark's maths: per-request metrics from a chunk timeline, and their aggregates.

Pure functions over plain numbers (no I/O, no clocks), so every definition is tested on hand-made
timelines. The definitions follow vLLM's ``bench serve``:

* a request is sent at ``send``; ``chunk_times`` are the arrival times (``time.perf_counter()``) of
  the streamed chunks that carried content (text); chunks without content (the role-only first chunk
  of a chat stream, the final usage chunk, ``[DONE]``) are not in the timeline.
* TTFT  = ``chunk_times[0] - send``
* E2E latency = ``chunk_times[-1] - send`` (the last content chunk, as vLLM's ``latency``)
* TPOT  = ``(E2E - TTFT) / (output_tokens - 1)``, defined only when ``output_tokens > 1``;
  ``output_tokens`` comes from the server's ``usage``, never from counting chunks (one chunk may
  carry several tokens).
* ITL   = the gaps between consecutive content chunks (so a request has ``len(chunk_times) - 1``).
* output speed of a request = ``(output_tokens - 1) / (E2E - TTFT)`` = 1 / TPOT: the tok/s a reader
  sees once the first token is out (the "average output speed" of the seeds' scenario tables is the
  mean of this over the scenario's requests).
* over a run of wall time ``duration`` (first send to last completion): output throughput =
  total output tokens / duration, request throughput = completed requests / duration, total token
  throughput = (input + output tokens) / duration, goodput = requests meeting every SLO / duration.
* a request meets the SLOs when TTFT <= ``ttft`` ms, TPOT <= ``tpot`` ms and E2E <= ``e2el`` ms for
  those given; a request with a single output token has no TPOT and meets a TPOT SLO (vLLM counts
  its TPOT as 0); failed requests never do.
* percentiles use numpy's default ("linear") method: for sorted ``x[0..n-1]`` and ``q`` in [0, 100],
  ``h = (n - 1) * q / 100`` and ``p = x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])``.

Latencies are reported in milliseconds, rates per second.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

STAT_KEYS = ("mean", "std", "min", "p50", "p90", "p99", "max")
SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between closest ranks (numpy's
    default method). Raises ValueError on an empty sequence or q outside [0, 100]."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def stats(values: Iterable[float]) -> dict[str, float | int | None]:
    """n, mean, population std (numpy's default), min, p50, p90, p99, max; None for each when empty."""
    xs = [float(v) for v in values]
    if not xs:
        return {"n": 0, **{k: None for k in STAT_KEYS}}
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return {"n": len(xs), "mean": mean, "std": std, "min": min(xs), "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99), "max": max(xs)}


@dataclass
class RequestResult:
    """What the client saw for one request (times in seconds, from one perf_counter clock)."""

    ok: bool
    send: float
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None                  # the stream's end ([DONE] or close)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    prompt_tokens_source: str | None = None   # "usage", "workload", "probe"
    output_tokens_source: str | None = None   # "usage", "max_tokens", "retokenized", "chunks"
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    max_tokens: int | None = None
    server_timings: dict[str, Any] | None = None   # llama.cpp's native server sends "timings"
    index: int = 0                            # position in the workload


@dataclass
class RequestMetrics:
    ttft: float | None        # seconds
    e2e: float | None
    tpot: float | None
    itl: list[float]
    output_speed: float | None   # tok/s after the first token


def request_metrics(r: RequestResult) -> RequestMetrics:
    """TTFT, E2E, TPOT, ITLs and output speed of one request (None where undefined)."""
    if not r.ok or not r.chunk_times:
        return RequestMetrics(None, None, None, [], None)
    ttft = r.chunk_times[0] - r.send
    e2e = r.chunk_times[-1] - r.send
    itl = [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = speed = None
    n = r.output_tokens
    if n is not None and n > 1:
        tpot = (e2e - ttft) / (n - 1)
        speed = (n - 1) / (e2e - ttft) if e2e > ttft else None
    return RequestMetrics(ttft, e2e, tpot, itl, speed)


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft:200,tpot:50[,e2el:5000]' (milliseconds) -> {'ttft': 200.0, 'tpot': 50.0, ...}."""
    out: dict[str, float] = {}
    if not text:
        return out
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, val = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: expected NAME:MS with NAME one of {', '.join(SLO_KEYS)}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"bad SLO {part!r}: {val!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"bad SLO {part!r}: must be > 0 ms")
        out[key] = ms
    return out


def meets_slo(m: RequestMetrics, slo: dict[str, float]) -> bool:
    """Whether one completed request meets every given SLO (ms); a missing TPOT counts as 0."""
    if m.ttft is None:
        return False
    if "ttft" in slo and m.ttft * 1000.0 > slo["ttft"]:
        return False
    if "tpot" in slo and m.tpot is not None and m.tpot * 1000.0 > slo["tpot"]:
        return False
    if "e2el" in slo and m.e2e * 1000.0 > slo["e2el"]:
        return False
    return True


def summarize(results: Sequence[RequestResult], duration: float,
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Aggregate metrics of one run (one sweep point) of wall time `duration` seconds."""
    done = [r for r in results if r.ok]
    ms = [request_metrics(r) for r in done]
    out_tokens = sum(r.output_tokens or 0 for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    s: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "input_tokens_known": all(r.prompt_tokens is not None for r in done),
        "request_throughput": rate(len(done)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
        "ttft_ms": stats(m.ttft * 1000.0 for m in ms if m.ttft is not None),
        "tpot_ms": stats(m.tpot * 1000.0 for m in ms if m.tpot is not None),
        "itl_ms": stats(g * 1000.0 for m in ms for g in m.itl),
        "e2el_ms": stats(m.e2e * 1000.0 for m in ms if m.e2e is not None),
        "output_speed_tok_s": stats(m.output_speed for m in ms if m.output_speed is not None),
        "output_tokens_per_request": stats(r.output_tokens for r in done if r.output_tokens is not None),
    }
    if slo:
        good = sum(1 for m in ms if meets_slo(m, slo))
        s["slo_ms"] = dict(slo)
        s["good_requests"] = good
        s["request_goodput"] = rate(good)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown error")[:200]
            errors[key] = errors.get(key, 0) + 1
    if errors:
        s["errors"] = errors
    return s


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers the seeds' scenario tables report, from a summary: average output speed (mean of
    the per-request output speeds), first-token latency (mean TTFT), per-request time (mean E2E),
    total time (the run's wall time) and throughput (output tokens / wall time)."""
    return {
        "avg_output_speed_tok_s": summary["output_speed_tok_s"]["mean"],
        "mean_ttft_ms": summary["ttft_ms"]["mean"],
        "mean_e2el_s": None if summary["e2el_ms"]["mean"] is None else summary["e2el_ms"]["mean"] / 1000.0,
        "total_time_s": summary["duration_s"],
        "output_throughput": summary["output_throughput"],
        "completed": summary["completed"],
        "failed": summary["failed"],
    }


def ratio(ours: float | None, peer: float | None) -> float | None:
    """ours / peer, or None when either is missing or the peer's is 0."""
    if ours is None or peer is None or peer == 0:
        return None
    return ours / peer
