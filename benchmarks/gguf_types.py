"""Per-type table for docs/BENCHMARKS.md: each GGUF file (by default the default model re-quantized by
llama.cpp's own quantizer, `benchmarks/requantize.py`) through `slipstream inspect` (runtime, load
time, resident memory against the file size) and `benchmarks/cpu_decode.py` (decode tok/s against
llama.cpp in the same run, greedy agreement of the exact path with transformers on the same file).

    python benchmarks/gguf_types.py                        # every file requantize.py writes
    python benchmarks/gguf_types.py --files a.gguf b.gguf --runs 3 --max-tokens 64 --json out.json

Ends with a markdown table. Run it on a quiet machine: the decode figures are medians of --runs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(cmd: list[str], timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="*", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--engines", default="slipstream,slipstream-exact,llama.cpp,transformers")
    ap.add_argument("--json", default=None)
    ap.add_argument("--llama-path", default=None, help="passed to cpu_decode.py: another llama-cpp-python build")
    ap.add_argument("--llama-batch", default=None, help="passed to cpu_decode.py: llama.cpp's n_batch")
    a = ap.parse_args()
    files = a.files
    if not files:
        out = run([sys.executable, str(HERE / "requantize.py")])
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        files = [line.split("\t")[1] for line in out.stdout.splitlines() if "\t" in line]
    rows = []
    for f in files:
        info = run([sys.executable, "-m", "slipstream", "inspect", f, "--json"])
        if info.returncode != 0:
            print(f"{f}: inspect failed: {info.stderr.strip()}", file=sys.stderr)
            continue
        r = json.loads(info.stdout)
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            dec = run([sys.executable, str(HERE / "cpu_decode.py"), "--model", f, "--engines", a.engines,
                       "--runs", str(a.runs), "--max-tokens", str(a.max_tokens), "--no-bandwidth",
                       "--json", tmp.name]
                      + (["--llama-path", a.llama_path] if a.llama_path else [])
                      + (["--llama-batch", a.llama_batch] if a.llama_batch else []))
            print(dec.stdout[-1500:], flush=True)
            d = json.loads(Path(tmp.name).read_text()) if dec.returncode == 0 else {}
        tps = {k: v.get("decode_tok_s", {}).get("median") for k, v in d.get("summary", {}).items()}
        agree = d.get("agreement", {}).get("transformers (exact)", {})
        shares = sorted(((v["params"] / max(1, r["parameters"]), k) for k, v in r["types"].items()), reverse=True)
        mix = ", ".join(f"{k} {100 * sh:.0f}%" for sh, k in shares if sh >= 0.01)
        rows.append({"file": Path(f).name, "mix": mix, "runtime": r["runtime"], "load_s": r["load_s"],
                     "resident_ratio": r["resident_bytes"] / r["file_bytes"], "file_mb": r["file_bytes"] / 1e6,
                     "tok_s": tps, "agreement": agree})
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print("\n| file | type mix (share of weights) | runtime | load s | resident / file | slipstream tok/s | "
          "exact tok/s | llama.cpp tok/s | ratio | exact greedy vs transformers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        t = x["tok_s"]
        s, e, ll = t.get("slipstream"), t.get("slipstream-exact"), t.get("llama.cpp")
        ratio = f"{s / ll:.2f}x" if s and ll else "-"
        ag = x["agreement"]
        agree = "-" if not ag else "identical" if ag.get("identical") else \
            f"first {ag.get('agree_prefix')} of {ag.get('length')}"
        f1 = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
        print(f"| {x['file']} | {x['mix']} | {x['runtime']} | {x['load_s']:.2f} | {x['resident_ratio']:.2f}x "
              f"({x['file_mb']:.0f} MB) | {f1(s)} | {f1(e)} | {f1(ll)} | {ratio} | {agree} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
