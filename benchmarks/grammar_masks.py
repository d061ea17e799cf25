"""The measurement behind the choice of grammar library: llguidance against xgrammar on the default
model's own tokenizer (SmolLM2's GGUF-embedded 49k byte-level BPE vocabulary).

For one JSON schema and a 23-token answer that follows it: the time to build the library's tokenizer
view, to compile the schema, and per token the time to fill the allowed-token bitmask (median and
worst step), following the answer token by token. Compact JSON in both (no whitespace, "," and ":").
A library that is not installed is skipped (xgrammar is not a dependency; `pip install xgrammar`).

    python benchmarks/grammar_masks.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
ANSWER = json.dumps({"name": "Alice Smith", "age": 42, "tags": ["a", "b", "c", "a"]}, separators=(",", ":"))


def _llguidance(tok, ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.torch

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=min(tok.eos_token_ids))
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(lt, grammar)
    t2 = time.perf_counter()
    bitmask = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)
    steps = []
    for t in ids:
        a = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
        steps.append(time.perf_counter() - a)
        assert m.consume_token(t), t
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "mask_median_s": statistics.median(steps),
            "mask_max_s": max(steps)}


def _xgrammar(tok, ids: list[int]) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size,
                             stop_token_ids=sorted(tok.eos_token_ids), add_prefix_space=False)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    m = xgr.GrammarMatcher(compiled)
    t2 = time.perf_counter()
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    steps = []
    for t in ids:
        a = time.perf_counter()
        m.fill_next_token_bitmask(bitmask, 0)
        steps.append(time.perf_counter() - a)
        assert m.accept_token(t), t
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "mask_median_s": statistics.median(steps),
            "mask_max_s": max(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="runs per library; medians are reported")
    args = ap.parse_args()

    from slipstream.tokenizer import Tokenizer
    from slipstream.weights import default_model_path

    tok = Tokenizer.from_gguf(default_model_path())
    ids = tok.encode(ANSWER, add_special_tokens=False)
    print(f"vocabulary {tok.vocab_size}, answer {len(ids)} tokens: {ANSWER}")
    for name, fn in (("llguidance", _llguidance), ("xgrammar", _xgrammar)):
        try:
            runs = [fn(tok, ids) for _ in range(args.repeat)]
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{name}: tokenizer {med['tokenizer_s'] * 1e3:.0f} ms, compile {med['compile_s'] * 1e3:.1f} ms, "
              f"mask median {med['mask_median_s'] * 1e6:.1f} us, worst step {med['mask_max_s'] * 1e3:.2f} ms "
              f"(medians of {args.repeat})")


if __name__ == "__main__":
    main()
