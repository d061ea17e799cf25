"""Probe a running OpenAI-compatible server the way issue 19's tests do, at any size: the bad-input
catalogue (tests/server/test_hostile_inputs.py), a big body while a stream runs, a soak of streams
with random disconnects, and a queue-overflow burst. Prints one JSON report; exits 1 on any 5xx,
lost stream or unhealthy server.

    .venv/bin/python benchmarks/server_probe.py --url http://127.0.0.1:8000 --soak 200 --burst 400
    .venv/bin/python benchmarks/server_probe.py --url ... --api-key KEY --skip catalogue

Works against Slipstream and, for the parts that do not depend on its limits, any other server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))


def catalogue(url: str, headers: dict) -> dict:
    from test_hostile_inputs import CASES

    counts: dict[str, int] = {}
    bad: list[str] = []
    with httpx.Client(timeout=120) as h:
        for name, method, path, body, hdrs in CASES:
            content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            r = h.request(method, url + path, content=content, headers={**hdrs, **headers})
            counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1
            if r.status_code >= 500 or h.get(url + "/health", headers=headers).status_code != 200:
                bad.append(f"{name}: {r.status_code} {r.text[:200]}")
    return {"cases": len(CASES), "statuses": counts, "failures": bad}


def big_body(url: str, headers: dict, mb: int) -> dict:
    times: list[float] = []
    stop = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                    if stop.is_set():
                        return

    t = threading.Thread(target=stream)
    t.start()
    while len(times) < 5 and t.is_alive():
        time.sleep(0.02)
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (mb << 20)}]}).encode()
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", content=big, timeout=600,
                   headers={**headers, "content-type": "application/json"})
    answered = time.perf_counter() - t0
    t1 = time.perf_counter()
    while t.is_alive() and (not times or times[-1] < t1):
        time.sleep(0.02)
    stop.set()
    t.join(60)
    gaps = [b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1]
    return {"status": r.status_code, "answer_s": round(answered, 3),
            "max_gap_while_big_body_s": round(max(gaps), 3) if gaps else None}


async def soak(url: str, headers: dict, n: int, leave_frac: float, concurrency: int) -> dict:
    rng = random.Random(19)
    leave = set(rng.sample(range(n), int(n * leave_frac)))
    out = {"done": 0, "left": 0, "lost": 0}

    async def one(c: httpx.AsyncClient, sem: asyncio.Semaphore, i: int) -> None:
        body = {"prompt": f"Note {i}:", "max_tokens": 8, "stream": True, "ignore_eos": True, "seed": i,
                "temperature": 0.8}
        async with sem:
            try:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    last = ""
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            last = line
                            if i in leave:
                                out["left"] += 1
                                return
                out["done" if last == "data: [DONE]" else "lost"] += 1
            except httpx.HTTPError:
                out["lost"] += 1

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency + 8)) as c:
        await asyncio.gather(*(one(c, sem, i) for i in range(n)))
    return out


async def overflow(url: str, headers: dict, n: int) -> dict:
    statuses: dict[str, int] = {}
    retry_after_missing = 0

    async def one(c: httpx.AsyncClient, i: int) -> None:
        nonlocal retry_after_missing
        r = await c.post("/v1/completions", json={"prompt": f"Burst {i}", "max_tokens": 4})
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
        if r.status_code == 503 and "retry-after" not in r.headers:
            retry_after_missing += 1

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                                 limits=httpx.Limits(max_connections=n)) as c:
        await asyncio.gather(*(one(c, i) for i in range(n)))
    return {"requests": n, "statuses": statuses, "503_without_retry_after": retry_after_missing}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--soak", type=int, default=200, help="streams in the soak")
    ap.add_argument("--leave", type=float, default=0.3, help="fraction of soak streams that disconnect")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--burst", type=int, default=300, help="simultaneous requests in the queue-overflow burst")
    ap.add_argument("--big-mb", type=int, default=10)
    ap.add_argument("--skip", action="append", default=[], choices=["catalogue", "big", "soak", "overflow"])
    args = ap.parse_args()
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    report: dict = {}
    if "catalogue" not in args.skip:
        report["catalogue"] = catalogue(url, headers)
    if "big" not in args.skip:
        report["big_body"] = big_body(url, headers, args.big_mb)
    if "soak" not in args.skip:
        report["soak"] = asyncio.run(soak(url, headers, args.soak, args.leave, args.concurrency))
    if "overflow" not in args.skip:
        report["overflow"] = asyncio.run(overflow(url, headers, args.burst))
    report["healthy_at_end"] = httpx.get(url + "/health", headers=headers, timeout=30).status_code == 200
    print(json.dumps(report, indent=1))
    ok = report["healthy_at_end"] and not report.get("catalogue", {}).get("failures") and \
        not report.get("soak", {}).get("lost") and "500" not in report.get("overflow", {}).get("statuses", {})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
