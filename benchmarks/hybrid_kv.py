"""What Gemma's hybrid KV cache saves: a long prompt and a short answer through the engine on a Gemma 3
shaped model (random weights, 18 layers, 5 sliding-window layers per global one, window 512, one KV head of
256 dims: Gemma 3 270M's attention), once with the sliding layers' parts given back outside the window
(the default) and once keeping every part (as before `kv.blocks.HybridKVCache`). Each run in a process
of its own; reported: peak blocks (global layers) and parts (sliding layers) in use, the KV bytes they
hold, and the process's resident memory added by the run (the cache's pages are committed when written).

    python benchmarks/hybrid_kv.py [--prompt 3000] [--new 32] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

LAYERS, WINDOW = 18, 512


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_one(folder: str, prompt: int, new: int, keep: bool) -> dict:
    import torch

    from slipstream.engine.config import EngineConfig
    from slipstream.engine.engine import Engine
    from slipstream.engine.request import Request
    from slipstream.engine.sampling import SamplingParams
    from slipstream.models import build_model
    from slipstream.weights import load_model
    from slipstream.weights.safetensors import load_hf

    tok = load_model(None).tokenizer             # the default model's: the same vocabulary size
    cfg, weights = load_hf(Path(folder))
    model = build_model(cfg, weights)
    eng = Engine(model, tok, EngineConfig(max_model_len=prompt + new + 16, runtime="native"))
    kv = eng.kv
    if keep:
        kv.local_window = 10 ** 9
    peak = {"blocks": 0, "parts": 0}
    step = eng.step

    def counted():
        events = step()
        peak["blocks"] = max(peak["blocks"], kv.allocator.num_in_use)
        peak["parts"] = max(peak["parts"], kv.parts_touched)
        return events
    eng.step = counted
    ids = torch.randint(100, 40000, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    before = _rss()
    req = Request(ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    for _ in eng.run([req]):
        pass
    grown = _rss() - before
    per_slot = kv.k[0, 0].numel() * kv.k.element_size() * 2     # K and V of one token in one layer
    n_global, n_local = kv.k.shape[0], kv.k_local.shape[0]
    held = (peak["blocks"] * n_global + peak["parts"] * n_local) * kv.block_size * per_slot
    return {"keep_every_part": keep, "prompt": prompt, "new": new, "peak_blocks": peak["blocks"],
            "peak_parts": peak["parts"], "kv_mb_held": held / 1e6, "rss_mb_added": grown / 1e6,
            "tokens": len(req.output_ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._one:
        print(json.dumps(run_one(a._one[0], a.prompt, a.new, a._one[1] == "keep")))
        return
    import torch
    import transformers
    types = (["sliding_attention"] * 5 + ["full_attention"]) * (LAYERS // 6)
    c = transformers.Gemma3TextConfig(vocab_size=49152, hidden_size=640, intermediate_size=2048,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=1,
                                      head_dim=256, sliding_window=WINDOW, layer_types=types,
                                      max_position_embeddings=32768, query_pre_attn_scalar=256)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        transformers.Gemma3ForCausalLM(c).to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
        for mode in ("drop", "keep"):
            out = subprocess.run([sys.executable, __file__, "--prompt", str(a.prompt), "--new", str(a.new),
                                  "--_one", d, mode], capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                sys.exit(out.stderr[-3000:])
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| sliding layers' parts | prompt + new | peak blocks | peak parts | KV held MB | RSS added MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mode = "kept (before)" if r["keep_every_part"] else "given back (default)"
        print(f"| {mode} | {r['prompt']} + {r['new']} | {r['peak_blocks']} | {r['peak_parts']} | "
              f"{r['kv_mb_held']:.1f} | {r['rss_mb_added']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
