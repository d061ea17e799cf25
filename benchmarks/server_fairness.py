"""Inter-token latency of one stream while a burst of prompts is prefilled (issue 19's fairness check).

One completions stream runs alone for a while (its idle inter-token gaps are measured), then 31
prompts of 256 tokens each arrive at once; the gaps of the first stream while they are prefilled
(from the burst until every one of them has its first token) are the "burst" gaps. Each round
starts a fresh `slipstream serve` (the default model) with the given extra arguments; the median
over rounds of each statistic is printed and written as JSON.

    .venv/bin/python benchmarks/server_fairness.py --rounds 3 \
        --variant "before=--prefill-budget 512" --variant "after=--prefill-budget 64" --out result.json

`--engine-only` runs the same workload through the engine in-process (no HTTP server, no event loop):
the difference between the two is what the server adds.

Variants run interleaved (round 1: before, after; round 2: before, after; ...), so load from
neighbours on a shared machine falls on both alike; take medians over rounds and say so.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


async def _round(base: str, burst: int, prompt_len: int, idle_tokens: int, seed: int) -> dict:
    times: list[float] = []
    burst_t0: list[float] = []
    first_tokens: list[float] = []

    async with httpx.AsyncClient(timeout=3600) as c:
        async def main_stream() -> None:
            body = {"prompt": "Once upon a time in a quiet village by the sea,", "max_tokens": 1500,
                    "ignore_eos": True, "stream": True, "temperature": 0}
            async with c.stream("POST", f"{base}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
                        if first_tokens and len(first_tokens) == burst and times[-1] > max(first_tokens) + 0.5:
                            return

        async def one(i: int) -> None:
            # distinct token-id prompts (no prefix-cache hits): 256 tokens each
            ids = [(seed * 7919 + i * 131 + k * 17) % 40000 + 100 for k in range(prompt_len)]
            body = {"prompt": ids, "max_tokens": 2, "ignore_eos": True, "stream": True}
            async with c.stream("POST", f"{base}/v1/completions", json=body) as r:
                r.raise_for_status()
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        first_tokens.append(time.perf_counter())
                        break
                async for _ in lines:
                    pass

        task = asyncio.create_task(main_stream())
        while len(times) < idle_tokens + 1:
            if task.done():
                task.result()
                raise SystemExit("the first stream ended before the burst")
            await asyncio.sleep(0.01)
        burst_t0.append(time.perf_counter())
        await asyncio.gather(*(one(i) for i in range(burst)))
        await task
    return _stats(times, burst_t0[0], first_tokens, idle_tokens)


def _stats(times: list[float], t0: float, first_tokens: list[float], idle_tokens: int) -> dict:
    """The first stream's gaps before the burst (idle) and while it is prefilled (from `t0`, the burst's
    arrival, until the last of its prompts has its first token), and the burst's own time to first token."""
    t1 = max(first_tokens)
    idle = [b - a for a, b in zip(times[1:idle_tokens + 1], times[2:idle_tokens + 1])]
    during = [b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1]
    ttft = [t - t0 for t in first_tokens]
    return {"idle_itl_p50_ms": 1e3 * statistics.median(idle), "burst_itl_p50_ms": 1e3 * statistics.median(during),
            "burst_itl_p90_ms": 1e3 * _pct(during, 90), "burst_itl_p99_ms": 1e3 * _pct(during, 99),
            "burst_itl_max_ms": 1e3 * max(during), "burst_prefill_s": t1 - t0,
            "burst_ttft_p50_s": statistics.median(ttft), "burst_gaps": len(during), "all_gaps": len(times) - 1}


def _start(extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "slipstream", "serve", "--port", str(port), "--no-access-log",
                             "--max-model-len", "2048", *extra], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not come up")


def _engine_round(extra: list[str], burst: int, prompt_len: int, idle_tokens: int, seed: int) -> dict:
    """The same workload through the engine alone (no HTTP, no event loop), in this process: what the
    engine's scheduling and steps cost, apart from the server around them. `extra` may hold
    `--prefill-pacing F|off`, `--prefill-budget N` and `--max-batch N` as `serve` takes them (serve's
    defaults otherwise)."""
    from slipstream import LLM, SamplingParams
    from slipstream.engine.request import Request
    opts = dict(zip(extra[::2], extra[1::2]))
    pacing = opts.get("--prefill-pacing", "2")
    budget = opts.get("--prefill-budget")
    llm = LLM(None, max_model_len=2048, prefill_pacing=None if pacing == "off" else float(pacing),
              prefill_budget=int(budget) if budget else 64, max_batch=int(opts.get("--max-batch", 32)))
    eng = llm.engine
    main = Request(llm.tokenizer.encode("Once upon a time in a quiet village by the sea,"),
                   SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0))
    eng.add_request(main)
    times: list[float] = []
    first_tokens: dict[str, float] = {}

    def step() -> None:
        events = eng.step()
        now = time.perf_counter()
        for e in events:
            rid = e.request.request_id if e.token_ids else None
            if rid == main.request_id:
                times.append(now)
            elif rid is not None and rid not in first_tokens:
                first_tokens[rid] = now
    while len(times) < idle_tokens + 1:
        step()
    t0 = time.perf_counter()
    reqs = [Request([(seed * 7919 + i * 131 + k * 17) % 40000 + 100 for k in range(prompt_len)],
                    SamplingParams(max_tokens=2, ignore_eos=True)) for i in range(burst)]
    for r in reqs:
        eng.add_request(r)
    while len(first_tokens) < burst:
        step()
    return _stats(times, t0, list(first_tokens.values()), idle_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burst", type=int, default=31)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--idle-tokens", type=int, default=30)
    ap.add_argument("--variant", action="append", default=None, metavar="NAME=ARGS",
                    help="a server configuration: NAME=extra `slipstream serve` arguments (repeatable)")
    ap.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    ap.add_argument("--engine-only", action="store_true",
                    help="run each variant's workload through the engine in this process instead of a server "
                         "(separates the engine's own cost from the HTTP server's)")
    args = ap.parse_args()
    variants = [(v.split("=", 1)[0], v.split("=", 1)[1].split()) for v in args.variant or ["default="]]
    rounds: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for k in range(args.rounds):
        for name, extra in variants:
            if args.engine_only:
                res = _engine_round(extra, args.burst, args.prompt_len, args.idle_tokens, k)
                res["load_avg_1m"] = os.getloadavg()[0]
                print(json.dumps({"variant": name, "round": k, **res}), flush=True)
                rounds[name].append(res)
                continue
            log = Path(f"/tmp/server_fairness_{os.getpid()}_{name}_{k}.log")
            proc, base = _start(extra, log)
            try:
                res = asyncio.run(_round(base, args.burst, args.prompt_len, args.idle_tokens, k))
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            res["load_avg_1m"] = os.getloadavg()[0]
            print(json.dumps({"variant": name, "round": k, **res}), flush=True)
            rounds[name].append(res)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "burst": args.burst,
               "prompt_len": args.prompt_len, "variants": {}}
    for name, extra in variants:
        rs = rounds[name]
        keys = [key for key in rs[0] if isinstance(rs[0][key], float)]
        med = {key: statistics.median(r[key] for r in rs) for key in keys}
        med["p99_over_idle"] = med["burst_itl_p99_ms"] / med["idle_itl_p50_ms"]
        summary["variants"][name] = {"serve_args": extra, "rounds": rs, "median": med}
        print(json.dumps({"variant": name, "median": med}, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
