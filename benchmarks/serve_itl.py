"""What the server adds to each token: inter-token latency of one streamed completion through
`slipstream serve` (the openai client on 127.0.0.1) against `LLM.stream` in process, same model, same
prompt, greedy, end-of-sequence ignored. Prints the median gap of each run after a warm-up.

    python benchmarks/serve_itl.py [--model PATH] [--max-tokens 200] [--runs 3] [--only serve|engine]
"""
from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def _p50_ms(stamps: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:])) * 1e3


def serve_itl(model: str | None, max_tokens: int, runs: int) -> list[float]:
    import httpx
    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "slipstream", "serve", *([model] if model else []), "--port", str(port),
           "--no-access-log"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the server exited; its log: {log.name}")
            time.sleep(0.2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        name = client.models.list().data[0].id
        out = []
        for r in range(runs + 1):
            stamps = []
            for ch in client.completions.create(model=name, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}):
                if ch.choices and ch.choices[0].text:
                    stamps.append(time.perf_counter())
            if r:   # the first run warms up
                out.append(_p50_ms(stamps))
        return out
    finally:
        proc.terminate()
        proc.wait()


def engine_itl(model: str | None, max_tokens: int, runs: int) -> list[float]:
    from slipstream import LLM, SamplingParams

    llm = LLM(model)
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = []
    for r in range(runs + 1):
        stamps = [time.perf_counter() for ch in llm.stream(ids, params) if ch.token_ids]
        if r:
            out.append(_p50_ms(stamps))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF or model directory (default: the embedded model)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=["serve", "engine"], default=None)
    a = ap.parse_args()
    if a.only != "engine":
        print("serve  ITL p50 ms per run:", [round(x, 3) for x in serve_itl(a.model, a.max_tokens, a.runs)])
    if a.only != "serve":
        print("engine ITL p50 ms per run:", [round(x, 3) for x in engine_itl(a.model, a.max_tokens, a.runs)])


if __name__ == "__main__":
    main()
