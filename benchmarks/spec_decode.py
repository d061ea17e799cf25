"""N-gram speculative decoding on the CPU: Slipstream and llama.cpp, each with and without it.

Task: input-echoing prompts on the embedded SmolLM2-135M GGUF (a completion prompt that makes the
model write a file again with one function renamed, and one that repeats a paragraph), greedy,
`--max-tokens` new tokens with end-of-sequence ignored, batch 1, 2 threads. Every configuration
gets the same prompt token ids, one untimed warm-up and `--runs` timed runs in its own child
process (one after another); we report the median decode tok/s ((n - 1) / (t_n - t_1), prefill
excluded) and, for Slipstream, accepted tokens per verification step.

* slipstream:         LLM(speculative=None | "ngram", num_speculative_tokens=K).stream(ids)
* llama.cpp:          Llama(...).generate(ids, temp=0)  /  Llama(..., draft_model=
                      LlamaPromptLookupDecoding(num_pred_tokens=K)) (llama-cpp-python's prompt lookup)

`--batch-sweep` also measures Slipstream's total tok/s with and without speculation at 1..8
concurrent echo requests, the measurement behind the engine's SPEC_MAX_BATCH (speculation is
switched off above the largest batch where it still wins).

    python benchmarks/spec_decode.py [--runs 3] [--k 4] [--batch-sweep] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CODE = '''def compute_total(items):
    total = 0
    for item in items:
        total += item.price * item.quantity
    return total


def compute_average(items):
    if not items:
        return 0
    return compute_total(items) / len(items)


def most_expensive(items):
    best = None
    for item in items:
        if best is None or item.price > best.price:
            best = item
    return best
'''
PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, trimmed the wick, "
             "polished the great lens until it shone, and wrote the weather in a leather logbook that "
             "had belonged to his grandfather.")
TASKS = {
    "rename-function": "# utils.py, version 1\n" + CODE +
                       "\n\n# utils.py, version 2 (same code, compute_total renamed to sum_prices)\n",
    "repeat-paragraph": f"Original: {PARAGRAPH}\nCopy: {PARAGRAPH}\nOriginal: {PARAGRAPH}\nCopy:",
}


def _time(tokens_iter, n: int) -> tuple[float, int]:
    stamps = []
    for _ in tokens_iter:
        stamps.append(time.perf_counter())
        if len(stamps) >= n:
            break
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps)


def child(engine: str, spec: bool, k: int, task: str, max_tokens: int, runs: int) -> dict:
    from slipstream.weights import default_model_path
    from slipstream import LLM, SamplingParams

    path = default_model_path()
    from slipstream.tokenizer import Tokenizer
    ids = Tokenizer.from_gguf(path).encode(TASKS[task])
    out: dict = {"engine": engine, "speculative": spec, "k": k if spec else 0, "task": task, "prompt_tokens": len(ids)}
    speeds = []
    if engine == "slipstream":
        llm = LLM(path, speculative="ngram" if spec else None, num_speculative_tokens=k)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for i in range(runs + 1):
            llm.engine.prefix_cache.enabled = False
            s, n = _time((c for c in llm.stream(ids, params) for _ in c.token_ids), max_tokens)
            if i:
                speeds.append(s)
        out["accepted_tokens_per_step"] = llm.engine.spec.accepted_tokens_per_step if spec else 1.0
    else:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if spec else None
        llm = llama_cpp.Llama(str(path), n_ctx=len(ids) + max_tokens + 64, n_threads=2, n_threads_batch=2,
                              verbose=False, draft_model=draft)
        for i in range(runs + 1):
            llm.reset()
            s, n = _time(llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0), max_tokens)
            if i:
                speeds.append(s)
        out["version"] = llama_cpp.__version__
    out["decode_tok_s"] = statistics.median(speeds)
    out["runs"] = speeds
    return out


def child_batch(batch: int, spec: bool, k: int, max_tokens: int, runs: int) -> dict:
    from slipstream import LLM, SamplingParams

    llm = LLM(speculative="ngram" if spec else None, num_speculative_tokens=k)
    llm.engine.spec_max_batch = 64          # measure it on, whatever the default threshold
    llm.engine.prefix_cache.enabled = False
    # distinct prompts (identical ones would be merged into one computation)
    prompts = [f"# file {i}\n" + TASKS["rename-function"] for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rates = []
    for i in range(runs + 1):
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t
        if i:
            rates.append(sum(len(o.token_ids) for o in outs) / dt)
    return {"batch": batch, "speculative": spec, "total_tok_s": statistics.median(rates), "runs": rates}


def spawn(args: list[str]) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--engines", default="slipstream,llama.cpp")
    ap.add_argument("--batch-sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        c = json.loads(a.child)
        res = child_batch(*c[1:]) if c[0] == "batch" else child(*c)
        print(json.dumps(res))
        return
    results = []
    for task in TASKS:
        for engine in a.engines.split(","):
            for spec in (False, True):
                r = spawn([engine, spec, a.k, task, a.max_tokens, a.runs])
                results.append(r)
                aps = f"  accepted/step {r['accepted_tokens_per_step']:.2f}" if "accepted_tokens_per_step" in r else ""
                print(f"{task:17s} {engine:10s} {'ngram k=' + str(a.k) if spec else 'plain':9s} "
                      f"{r['decode_tok_s']:7.1f} tok/s{aps}", flush=True)
    sweep = []
    if a.batch_sweep:
        for b in (1, 2, 3, 4, 8):
            pair = [spawn(["batch", b, spec, a.k, 96, a.runs]) for spec in (False, True)]
            sweep += pair
            print(f"batch {b}: plain {pair[0]['total_tok_s']:.1f} tok/s, ngram {pair[1]['total_tok_s']:.1f} tok/s "
                  f"({pair[1]['total_tok_s'] / pair[0]['total_tok_s']:.2f}x)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(a),
                       "results": results, "batch_sweep": sweep}, f, indent=1)


if __name__ == "__main__":
    main()
