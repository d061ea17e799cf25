"""Running scenarios against one target: warm-up, the timed runs, token counts, summaries."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from slipstream.bench.client import (HttpTokenizer, Prompt, Target, discover_model, fill_token_counts,
                                     make_client, run_closed_loop, run_poisson, send_request)
from slipstream.bench.metrics import RequestResult, headline, request_metrics, summarize
from slipstream.bench.peers import BenchError
from slipstream.bench.workloads import ScenarioSpec, build_random_prompts, conversation_prompt

FIXED_FIELDS = ("ignore_eos", "min_tokens")


@dataclass
class RunOptions:
    temperature: float = 0.0
    seed: int = 0
    slo: dict[str, float] = field(default_factory=dict)
    progress: bool = True
    timeout_s: float = 600.0
    warmup: int = 1
    keep_text: bool = True        # store generated texts of non-serving scenarios in the JSON


@dataclass
class TargetSession:
    """What was learnt about a target before its runs."""

    target: Target
    fixed_fields: tuple[str, ...] = FIXED_FIELDS
    tokenizer: HttpTokenizer | None = None
    notes: list[str] = field(default_factory=list)


def _progress(total: int, desc: str, enabled: bool) -> tuple[Callable[[RequestResult], None], Callable[[], None]]:
    if not enabled:
        return (lambda r: None), (lambda: None)
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)
    failed = 0

    def update(r: RequestResult) -> None:
        nonlocal failed
        if not r.ok:
            failed += 1
            bar.set_postfix(failed=failed)
        bar.update(1)

    return update, bar.close


async def prepare(client: httpx.AsyncClient, target: Target, opts: RunOptions) -> TargetSession:
    """Find the model name, check that the endpoint streams, learn whether it takes the
    fixed-length fields (``ignore_eos``, ``min_tokens``), find its tokenizer endpoint, and warm it up."""
    sess = TargetSession(target)
    if not target.model:
        target.model = await discover_model(client, target)
    warm = Prompt([{"role": "user", "content": "Say hello."}], 8, fixed_length=True)
    # a strict server answers 400/422 to a field it does not know: try the fixed-length fields
    # together, then each alone, then none
    refused = []
    for fields in (FIXED_FIELDS, ("ignore_eos",), ("min_tokens",), ()):
        r = await send_request(client, target, warm, temperature=opts.temperature, fixed_fields=fields)
        if r.ok or not (r.error or "").startswith(("HTTP 400", "HTTP 422")):
            break
        refused.append(f"{'+'.join(fields) or 'none'}: {r.error}")
    sess.fixed_fields = fields
    if refused and r.ok:
        sess.notes.append("fixed output lengths use " + ("+".join(fields) or "max_tokens only")
                          + "; refused: " + "; ".join(refused))
    if not r.ok:
        raise BenchError(f"{target.label} at {target.url} does not answer a streaming request: {r.error}")
    for _ in range(max(0, opts.warmup - 1)):
        await send_request(client, target, warm, temperature=opts.temperature, fixed_fields=sess.fixed_fields)
    tok = HttpTokenizer(client, target)
    await tok.probe()
    sess.tokenizer = tok if tok.kind else None
    return sess


def request_record(r: RequestResult, t0: float, keep_text: bool) -> dict[str, Any]:
    m = request_metrics(r)
    rec: dict[str, Any] = {
        "index": r.index, "ok": r.ok, "error": r.error, "send_offset_s": r.send - t0,
        "ttft_ms": None if m.ttft is None else m.ttft * 1e3,
        "tpot_ms": None if m.tpot is None else m.tpot * 1e3,
        "e2el_ms": None if m.e2e is None else m.e2e * 1e3,
        "output_speed_tok_s": m.output_speed,
        "itl_ms": [g * 1e3 for g in m.itl],
        "content_chunks": len(r.chunk_times),
        "prompt_tokens": r.prompt_tokens, "prompt_tokens_source": r.prompt_tokens_source,
        "output_tokens": r.output_tokens, "output_tokens_source": r.output_tokens_source,
        "max_tokens": r.max_tokens, "finish_reason": r.finish_reason,
    }
    if r.server_timings:
        rec["server_timings"] = r.server_timings
    if keep_text:
        rec["text"] = r.text
    return rec


PREFIX_COUNTERS = ("slipstream_prefix_cache_queries_total", "slipstream_prefix_cache_hits_total")


async def prefix_counters(client: httpx.AsyncClient, target: Target) -> tuple[float, float] | None:
    """(prompt tokens looked up, tokens found) in the target's prefix cache, from its Prometheus
    /metrics (the totals over all replicas behind `serve --replicas`); None when it has no such metrics."""
    try:
        r = await client.get(target.base_url + "/metrics", headers=target.headers(), timeout=30)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    found: dict[str, float] = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name in PREFIX_COUNTERS:
            try:
                found[name] = float(value)
            except ValueError:
                return None
    if len(found) != len(PREFIX_COUNTERS):
        return None
    return found[PREFIX_COUNTERS[0]], found[PREFIX_COUNTERS[1]]


def point_label(point: dict[str, Any], mode: str) -> str:
    if "concurrency" in point:
        return f"concurrency={point['concurrency']}"
    if "request_rate" in point:
        return f"rate={point['request_rate']:g}/s"
    return {"sequential": "sequential", "batch": "all at once", "conversation": "10 rounds"}.get(mode, mode)


async def run_point(client: httpx.AsyncClient, sess: TargetSession, spec: ScenarioSpec, point: dict[str, Any],
                    prompts: list[Prompt], opts: RunOptions) -> dict[str, Any]:
    """One timed run (one sweep point) of a scenario; returns its JSON record."""
    target = sess.target
    label = point_label(point, spec.mode)
    if spec.mode == "conversation":
        label = f"{len(prompts)} rounds"
    update, close = _progress(len(prompts), f"{target.label} {spec.name} {label}", opts.progress)
    prefix_before = await prefix_counters(client, target)
    t_start = time.perf_counter()
    sent: list[Prompt] = list(prompts)

    async def send(i: int) -> RequestResult:
        return await send_request(client, target, sent[i], temperature=opts.temperature,
                                  fixed_fields=sess.fixed_fields, index=i)

    try:
        if spec.mode == "conversation":
            results: list[RequestResult] = []
            history: list[dict[str, str]] = []
            for i, turn in enumerate(p.messages[-1]["content"] for p in prompts):
                history.append({"role": "user", "content": turn})
                sent[i] = conversation_prompt(history, prompts[i].max_tokens, prompts[i].fixed_length)
                r = await send(i)
                update(r)
                results.append(r)
                history.append({"role": "assistant", "content": r.text})
            duration = time.perf_counter() - t_start
        elif spec.mode == "sequential":
            results, duration = await run_closed_loop(send, len(sent), 1, update)
        elif spec.mode == "batch":
            results, duration = await run_closed_loop(send, len(sent), len(sent), update)
        elif "request_rate" in point:
            results, duration = await run_poisson(send, len(sent), point["request_rate"], opts.seed, update)
        else:
            results, duration = await run_closed_loop(send, len(sent), point.get("concurrency", 1), update)
    finally:
        close()
    warnings = await fill_token_counts(client, target, results, sent, sess.tokenizer)
    early = sum(1 for r, p in zip(results, sent) if r.ok and p.fixed_length and r.output_tokens is not None
                and r.output_tokens < p.max_tokens)
    if early:
        warnings.append(f"{target.label} {spec.name} {label}: {early} request(s) stopped before max_tokens "
                        "although a fixed length was asked for (the server does not honour ignore_eos/min_tokens)")
    summary = summarize(results, duration, opts.slo or None)
    prefix_after = await prefix_counters(client, target) if prefix_before is not None else None
    if prefix_before is not None and prefix_after is not None and prefix_after[0] > prefix_before[0]:
        queried, hits = prefix_after[0] - prefix_before[0], prefix_after[1] - prefix_before[1]
        summary["prefix_cache"] = {"queried_tokens": queried, "hit_tokens": hits, "hit_rate": hits / queried}
    keep_text = opts.keep_text and spec.mode != "serving"
    return {"label": label, **point, "summary": summary, "headline": headline(summary), "warnings": warnings,
            "requests": [request_record(r, t_start, keep_text) for r in results]}


async def run_target(target: Target, specs: list[ScenarioSpec], opts: RunOptions,
                     workload_cache: dict[str, Any], log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run every scenario against one target. ``workload_cache`` holds prompts built against an
    earlier target (random-token prompts), so a peer gets exactly the same texts."""
    async with make_client(opts.timeout_s) as client:
        sess = await prepare(client, target, opts)
        out: dict[str, Any] = {"model": target.model, "endpoint": target.endpoint, "url": target.url,
                               "fixed_length_fields": list(sess.fixed_fields),
                               "tokenizer_endpoint": sess.tokenizer.kind if sess.tokenizer else None,
                               "notes": list(sess.notes), "scenarios": {}}
        for spec in specs:
            prompts = spec.prompts
            cfg = dict(spec.config)
            if spec.mode == "serving" and cfg.get("dataset") == "random":
                # distinct prompts for every sweep point, so no point is served from a prefix cache
                # that an earlier one filled
                if "random" not in workload_cache:
                    workload_cache["random"] = await build_random_prompts(
                        client, target, sess.tokenizer, cfg["num_prompts"] * len(spec.points),
                        cfg["input_len"], cfg["output_len"], opts.seed)
                prompts, info = workload_cache["random"]
                cfg["prompt_construction"] = info
            points = []
            for k, point in enumerate(spec.points):
                if spec.mode == "serving":
                    n = cfg["num_prompts"]
                    rec = await run_point(client, sess, spec, point, prompts[k * n:(k + 1) * n], opts)
                else:
                    rec = await run_point(client, sess, spec, point, prompts, opts)
                h = rec["headline"]
                pc = rec["summary"].get("prefix_cache")
                log(f"{target.label:>12} {spec.name:<12} {rec['label']:<16} "
                    f"{h['completed']} ok, {h['failed']} failed, "
                    f"{_fmt(h['avg_output_speed_tok_s'])} tok/s per request, TTFT {_fmt(h['mean_ttft_ms'])} ms, "
                    f"{_fmt(h['output_throughput'])} output tok/s"
                    + (f", prefix-cache hits {100 * pc['hit_rate']:.1f}%" if pc else ""))
                points.append(rec)
            out["scenarios"][spec.name] = {"scenario": spec.name, "mode": spec.mode, "config": cfg, "points": points}
        return out


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"
