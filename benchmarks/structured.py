"""What constrained decoding costs: decode tokens/s with and without a JSON schema, batch 1 and 8.

One process, the embedded default model (SmolLM2-135M GGUF, the default fast CPU path), chat
prompts asking for a list of items. The constrained run uses a JSON schema that forces a long
answer (an object holding an array of 12 short strings, compact JSON); the plain run decodes the
same number of tokens per prompt (`max_tokens` set to the constrained answer's length, end of
sequence ignored), so both decode the same amount. The configurations are interleaved run by run
(plain, schema, plain, schema, ...) so drift of the machine's load hits both alike; each reports

* tok/s: output tokens of the batch / wall time from the first request's first token to the last
  one's last (decode only, prefill excluded), median over `--runs`;
* the ratio schema / plain (goal: constrained decoding costs under 10%, ratio >= 0.90).

    python benchmarks/structured.py [--runs 5] [--max-tokens 160] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 24},
        "items": {"type": "array", "minItems": 12, "maxItems": 12,
                  "items": {"type": "string", "minLength": 3, "maxLength": 24}},
    },
    "required": ["topic", "items"], "additionalProperties": False,
}
TOPICS = ["fruits", "European capitals", "programming languages", "board games", "rivers", "musical instruments",
          "kitchen tools", "planets and moons"]


def _batch_speed(llm, prompts: list[str], params) -> tuple[float, list[int]]:
    """(decode tok/s of the batch, output tokens per request)."""
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    first = min(o.metrics.first_token for o in outs)
    last = max(o.metrics.finished for o in outs)
    n = sum(len(o.token_ids) for o in outs) - len(outs)   # the first token of each comes from prefill
    return n / (last - first), [len(o.token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    from slipstream import LLM, SamplingParams
    from slipstream.structured.constraint import Constraint

    llm = LLM(enable_merging=False)
    constraint = Constraint.json_schema(SCHEMA)
    results = {"machine": _cpu_name(), "model": llm.model_name,
               "schema": SCHEMA, "runs": args.runs, "batches": {}}
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [f"List 12 {TOPICS[i % len(TOPICS)]} as JSON." for i in range(b)]
        constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0, constraint=constraint)
        _batch_speed(llm, prompts, constrained)          # warm-up: templates, grammar tokenizer, prefix cache
        plain_speeds, schema_speeds, lengths = [], [], []
        for _ in range(args.runs):
            s, lengths = _batch_speed(llm, prompts, constrained)
            schema_speeds.append(s)
            # the plain run decodes as many tokens per prompt as the constrained one did
            plain = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
            plain_speeds.append(_plain_batch(llm, prompts, plain))
        row = {"plain_tok_s": statistics.median(plain_speeds), "schema_tok_s": statistics.median(schema_speeds),
               "plain_runs": plain_speeds, "schema_runs": schema_speeds, "tokens_per_request": lengths}
        row["ratio"] = row["schema_tok_s"] / row["plain_tok_s"]
        results["batches"][b] = row
        print(f"batch {b}: plain {row['plain_tok_s']:.1f} tok/s, json schema {row['schema_tok_s']:.1f} tok/s, "
              f"ratio {row['ratio']:.3f} (median of {args.runs}; {sum(lengths)} tokens per batch)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _plain_batch(llm, prompts: list[str], params: list) -> float:
    """Like _batch_speed with one SamplingParams per prompt."""
    from slipstream.engine.request import Request

    reqs = []
    for p, sp in zip(prompts, params):
        text = llm.chat_prompt([{"role": "user", "content": p}])
        reqs.append(Request(llm.tokenizer.encode(text, add_special_tokens=False), sp, prompt=text))
    for _ in llm.engine.run(reqs):
        pass
    first = min(r.metrics.first_token for r in reqs)
    last = max(r.metrics.finished for r in reqs)
    return (sum(len(r.output_ids) for r in reqs) - len(reqs)) / (last - first)


if __name__ == "__main__":
    main()
