"""The eager prompt step in bf16 (weights.quant.blas_mode) against the same step in fp32: speed and quality.

On one GGUF (the embedded default model unless --model is given), the held-aside text
(benchmarks/data/heldout.txt, ~530 tokens) followed by the README (to fill --tokens) is run as prompt chunks of --chunk tokens through the model's eager step
(the BLAS path of long prompt chunks), once in fp32 and once in bf16, asking for every position's logits:

* perplexity of the text from those logits (teacher-forced), each way;
* the largest gap between the two ways' logits and how often their top token agrees;
* milliseconds per chunk, each way (median over the whole chunks, after a warm-up chunk).

bf16 only pays where the CPU multiplies bf16 in hardware (AMX or AVX-512 BF16: oneDNN through torch); the
runtime uses it where `bf16_blas_fast` says so: AMX, or AVX-512 BF16 (`CpuTeamDecoder.eager_blas`).

    python benchmarks/prefill_bf16.py [--model FILE] [--chunk 512] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
TEXTS = [ROOT / "data" / "heldout.txt", ROOT.parent / "README.md"]


def run(model, kv, ids: list[int], chunk: int, bf16: bool) -> tuple[torch.Tensor, list[float]]:
    """Every position's logits of `ids`, prompt chunk by chunk through the eager step; ms per chunk."""
    from slipstream.kv.blocks import SequenceKV
    from slipstream.step import prefill_step
    from slipstream.weights.quant import blas_mode

    seq = SequenceKV(kv)
    seq.reserve(len(ids))
    outs, times = [], []
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        t = time.perf_counter()
        with blas_mode("bf16" if bf16 else "fp32"):
            outs.append(model.forward(prefill_step(seq, part, start=s, logits="all"), kv).float())
        if len(part) == chunk:
            times.append((time.perf_counter() - t) * 1000)
        seq.num_tokens = s + len(part)
    seq.release()
    return torch.cat(outs), times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the held-aside text used")
    ap.add_argument("--json")
    a = ap.parse_args()
    from slipstream import LLM
    llm = LLM(a.model, max_model_len=a.tokens + 16)
    model, kv = llm.engine.model, llm.engine.kv
    ids = llm.tokenizer.encode("\n\n".join(p.read_text() for p in TEXTS))[: a.tokens]
    torch.set_num_threads(2)
    res = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        run(model, kv, ids[: a.chunk], a.chunk, bf16)   # warm-up
        logits, times = run(model, kv, ids, a.chunk, bf16)
        lp = torch.log_softmax(logits.double(), -1)
        nll = -lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item()
        res[name] = {"perplexity": math.exp(nll), "ms_per_chunk": statistics.median(times), "logits": logits}
    f, b = res["fp32"]["logits"], res["bf16"]["logits"]
    out = {"model": a.model or "default", "tokens": len(ids), "chunk": a.chunk,
           "fp32": {k: v for k, v in res["fp32"].items() if k != "logits"},
           "bf16": {k: v for k, v in res["bf16"].items() if k != "logits"},
           "max_logit_gap": (f - b).abs().max().item(), "logit_scale": f.abs().max().item(),
           "top1_agreement": (f.argmax(-1) == b.argmax(-1)).float().mean().item()}
    ppl_f, ppl_b = out["fp32"]["perplexity"], out["bf16"]["perplexity"]
    print(f"{out['model']}: {len(ids)} tokens in chunks of {a.chunk}")
    print(f"  perplexity fp32 {ppl_f:.4f}, bf16 {ppl_b:.4f} ({100 * (ppl_b / ppl_f - 1):+.2f}%)")
    print(f"  top-1 agreement {100 * out['top1_agreement']:.2f}%; largest logit gap {out['max_logit_gap']:.3f} "
          f"(largest logit {out['logit_scale']:.1f})")
    print(f"  ms per chunk: fp32 {out['fp32']['ms_per_chunk']:.0f}, bf16 {out['bf16']['ms_per_chunk']:.0f} "
          f"({out['fp32']['ms_per_chunk'] / out['bf16']['ms_per_chunk']:.2f}x)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
