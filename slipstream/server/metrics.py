"""Prometheus metrics of one server, in a registry of its own (several apps can live in one process).

Latency histograms and token counters are observed by the engine thread from the requests'
timestamps as their events come out; the engine's state (running / waiting requests, KV blocks,
prefix cache, merges, preemptions) is read at scrape time from the last `EngineStats` snapshot the
engine thread took. Names follow vLLM's, with the prefix `slipstream_`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "slipstream_"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineStatsCollector:
    """Gauges and counters read from the engine's last stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        get = (lambda name: float(getattr(s, name, 0) or 0)) if s is not None else (lambda name: 0.0)
        total, in_use = get("kv_blocks_total"), get("kv_blocks_in_use")
        gauges = [
            ("num_requests_running", "Requests in the running batch.", get("num_running")),
            ("num_requests_waiting", "Requests waiting to be scheduled.", get("num_waiting")),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all).",
             in_use / total if total else 0.0),
            ("kv_blocks_in_use", "KV-cache blocks in use.", in_use),
            ("kv_blocks_total", "KV-cache blocks in all.", total),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             get("prefix_cache_queried_tokens")),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", get("prefix_cache_hit_tokens")),
            ("merged_requests", "Requests merged into an identical in-flight request.", get("merged_requests")),
            ("preemptions", "Requests preempted to free KV-cache blocks.", get("preemptions")),
            ("spec_decode_num_draft_tokens", "Speculative guesses verified.", get("spec_drafted_tokens")),
            ("spec_decode_num_accepted_tokens", "Speculative guesses kept.", get("spec_accepted_tokens")),
            ("spec_decode_num_verifications", "Sequence-steps that verified guesses.", get("spec_verifications")),
            ("spec_decode_num_emitted_tokens", "Tokens produced by those sequence-steps.",
             get("spec_emitted_tokens")),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative guesses kept, by position in the guess.", labels=["position"])
        for i, n in enumerate(getattr(s, "spec_accepted_at", ()) or ()):
            per_pos.add_metric([str(i)], float(n))
        yield per_pos


class ServerMetrics:
    """The server's metrics; `render()` gives the Prometheus text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, stats: Callable[[], Any] = lambda: None):
        self.registry = r = CollectorRegistry()
        p = PREFIX
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between output tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram(p + "request_time_per_output_token_seconds",
                              "Per request: (e2e - TTFT) / (output tokens - 1).", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(p + "request_queue_time_seconds", "Time from arrival to being scheduled.",
                               buckets=REQUEST_BUCKETS, registry=r)
        self.prompt_tokens_hist = Histogram(p + "request_prompt_tokens", "Prompt tokens per request.",
                                            buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens_hist = Histogram(p + "request_generation_tokens", "Output tokens per request.",
                                                buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Output tokens generated.", registry=r)
        self.request_success = Counter(p + "request_success", "Requests finished, by finish reason.",
                                       ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(reason)
        r.register(_EngineStatsCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- observations (called from the engine thread) ------------------------------------------
    def on_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, n: int, first: bool, ttft: float | None, gap: float | None) -> None:
        """`n` new tokens; `first` when they start the output (observe TTFT), else `gap` seconds
        since the previous tokens (observed once per token, as gap / n)."""
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if first:
            if ttft is not None:
                self.ttft.observe(max(ttft, 0.0))
        elif gap is not None:
            per = max(gap, 0.0) / n
            for _ in range(n):
                self.itl.observe(per)

    def on_finished(self, reason: str, num_prompt: int, num_output: int, e2e: float | None,
                    queue: float | None, ttft: float | None) -> None:
        self.request_success.labels(reason).inc()
        self.prompt_tokens_hist.observe(num_prompt)
        self.generation_tokens_hist.observe(num_output)
        if e2e is not None:
            self.e2e.observe(max(e2e, 0.0))
        if queue is not None:
            self.queue.observe(max(queue, 0.0))
        if e2e is not None and ttft is not None and num_output > 1:
            self.tpot.observe(max(e2e - ttft, 0.0) / (num_output - 1))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value} (comments skipped); for tests and tools."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out
