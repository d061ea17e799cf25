"""Quality of the native CPU runtime's fast path (int8 activations) against its exact path and llama.cpp.

Two measurements on one GGUF (the embedded default model unless --model is given):

* perplexity over a held-aside text (benchmarks/data/heldout.txt, written for this project, never
  used for tuning), teacher-forced one token per decode step through the native runtime, so every
  token's logits come from the decode kernels being judged: exact path, fast path, and llama.cpp
  (llama-cpp-python built for this CPU, its logits for the same token ids);
* greedy agreement of the fast path with the exact path: for a few chat prompts, 128 greedy tokens
  each; the length of the common prefix and the share of positions that agree.

Usage::

    python benchmarks/cpu_quality.py [--model FILE] [--json out.json] [--tokens 128]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
TEXT = ROOT / "data" / "heldout.txt"
PROMPTS = ["Explain in a few sentences why the sky is blue during the day.",
           "Write a short story about a robot who learns to paint.",
           "List five tips for staying focused while studying.",
           "What is the difference between a virus and a bacterium?"]


def _native(model_path: str | None, exact: bool, kv_cache_dtype: str = "auto") -> Any:
    from slipstream import LLM
    return LLM(model_path, exact=exact, runtime="native", kv_cache_dtype=kv_cache_dtype)


def native_perplexity(llm: Any, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] given their prefixes: the first prediction from a one-token prefill,
    every later one from a decode step of the runtime being judged."""
    from slipstream.kv.blocks import SequenceKV
    from slipstream.step import decode_step, prefill_step

    engine = llm.engine
    model, dec, kv = engine.model, engine.runtime, engine.kv
    seq = SequenceKV(kv)
    seq.reserve(len(ids) + 1)
    logits = model.forward(prefill_step(seq, ids[:1]), kv)[0]
    seq.num_tokens = 1
    nll = 0.0
    for i in range(1, len(ids)):
        if i > 1:
            logits = dec.forward(decode_step([seq], [ids[i - 1]], [i - 1]))[0]
            seq.num_tokens = i
        nll -= torch.log_softmax(logits.double(), -1)[ids[i]].item()
    seq.release()
    return math.exp(nll / (len(ids) - 1))


def llama_cpp_perplexity(model_path: str, ids: list[int]) -> float | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    import numpy as np
    llm = llama_cpp.Llama(model_path, n_ctx=len(ids) + 8, n_threads=2, n_batch=1, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = -sum(logits[i - 1, ids[i]] - lse[i - 1] for i in range(1, len(ids)))
    return math.exp(nll / (len(ids) - 1))


def greedy(llm: Any, prompt: str, n: int) -> list[int]:
    from slipstream import SamplingParams
    out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return list(out[0].token_ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--text-tokens", type=int, default=512, help="tokens of the held-aside text to score")
    p.add_argument("--json", default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp16", "int8"],
                   help="the fast path's KV cache (the exact path keeps fp32)")
    args = p.parse_args(argv)
    from slipstream.weights import default_model_path
    path = args.model or str(default_model_path())
    exact, fast = _native(path, True), _native(path, False, args.kv_cache_dtype)
    ids = exact.tokenizer.encode(TEXT.read_text())[: args.text_tokens]
    res: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "model": path, "text_tokens": len(ids), "kv_cache_dtype": args.kv_cache_dtype}
    res["ppl_exact"] = native_perplexity(exact, ids)
    res["ppl_fast"] = native_perplexity(fast, ids)
    res["ppl_llama_cpp"] = llama_cpp_perplexity(path, ids)
    agree = []
    for prompt in PROMPTS:
        a, b = greedy(exact, prompt, args.tokens), greedy(fast, prompt, args.tokens)
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same = sum(x == y for x, y in zip(a, b)) / max(1, min(len(a), len(b)))
        agree.append({"prompt": prompt, "common_prefix": prefix, "same_share": same, "tokens": len(a)})
    res["greedy"] = agree
    rel = res["ppl_fast"] / res["ppl_exact"] - 1
    peer = res["ppl_llama_cpp"]
    print(f"perplexity over {len(ids)} held-aside tokens: exact {res['ppl_exact']:.4f}  fast {res['ppl_fast']:.4f} "
          f"({rel * 100:+.2f}%)  llama.cpp {'-' if peer is None else f'{peer:.4f}'}")
    for a in agree:
        print(f"  greedy fast vs exact: common prefix {a['common_prefix']:3d}/{a['tokens']}, "
              f"same tokens {a['same_share'] * 100:5.1f}%  ({a['prompt'][:40]}...)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
