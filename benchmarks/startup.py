"""Start-up to first token, with and without a compiled artifact (`slipstream compile`).

For each model source (the GGUF and its artifact) this runs, `--runs` times each, in a fresh process:
  * cli:  `python -m slipstream generate MODEL -p Hello --max-tokens 1` — process start to exit,
          the number a user waits for (Python and torch imports included);
  * load: inside one process, `LLM(MODEL)` construction, then `generate(max_tokens=1)` (TTFT),
          reported separately so the import cost does not hide the loading cost.
Medians are printed (and written with --json).

    python benchmarks/startup.py [--artifact DIR] [--runs 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from slipstream import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1] if sys.argv[1] != "-" else None)
t2 = time.perf_counter()
llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default=None, help="an existing artifact dir (default: compile one to a temp dir)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    art = a.artifact
    if art is None:
        art = tempfile.mkdtemp(prefix="slipstream-artifact-")
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "slipstream", "compile", "--out", art], check=True)
        print(f"compiled in {time.perf_counter() - t:.1f} s (one-off)")
    results = {}
    for label, model in (("gguf", "-"), ("artifact", art)):
        cli, inproc = [], []
        for _ in range(a.runs):
            args = [sys.executable, "-m", "slipstream", "generate"] + ([] if model == "-" else [model])
            t = time.perf_counter()
            subprocess.run(args + ["-p", "Hello", "--max-tokens", "1"], check=True, capture_output=True)
            cli.append(time.perf_counter() - t)
            out = subprocess.run([sys.executable, "-c", CHILD, model], check=True, capture_output=True, text=True)
            inproc.append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {k: statistics.median(r[k] for r in inproc) for k in inproc[0]}
        results[label] = {"cli_s": statistics.median(cli), **med, "runs": {"cli": cli, "inproc": inproc}}
        print(f"{label:8s}  CLI start-up to first token {results[label]['cli_s']:.2f} s   "
              f"(import {med['import_s']:.2f} s, load {med['load_s']:.2f} s, first token {med['first_token_s']:.3f} s)")
    print(f"artifact / gguf: CLI {results['artifact']['cli_s'] / results['gguf']['cli_s']:.2f}x, "
          f"load {results['artifact']['load_s'] / results['gguf']['load_s']:.3f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
