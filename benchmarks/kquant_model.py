"""A Llama-shaped GGUF whose every matrix llama.cpp can store as a K-quant, for speed comparisons on the
file types people download.

The embedded default model (SmolLM2-135M) has 576 features: llama.cpp's quantizer falls back to legacy
blocks (Q5_0, Q8_0, Q4_0) for most of its tensors when asked for Q4_K_M, so the per-type table built
from it (`gguf_types.py`) says little about real Q4_K_M files, which are almost all Q4_K and Q6_K. This
script writes a model with K-quant-friendly sizes (multiples of 256) and random weights, with the
default model's tokenizer and chat template, as float32, then quantizes it with llama.cpp's own
quantizer (`requantize.py`). Its text is nonsense; its speed is what a real file of its shape gets.

    python benchmarks/kquant_model.py                     # 1024 features, 16 layers: Q4_K_M, Q6_K
    python benchmarks/kquant_model.py --hidden 2048 --layers 8 --types Q4_K_M --out /tmp/kq
    python benchmarks/kquant_model.py --raw IQ2_XXS IQ3_XXS     # every matrix as random blocks of that type

`--raw` is for the types llama.cpp's quantizer will not write without an importance matrix (IQ1_*, IQ2_*)
or writes only in part: each matrix is hand-made valid blocks of the type (tests/support.random_blocks,
magnitude 1/sqrt(K)), embeddings and LM head included (tied), so the file is all that type.

Prints one line per file: type, path, size (as requantize.py does).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from requantize import requantize  # noqa: E402


def write_f32(path: Path, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int, seed: int,
              raw: str | None = None) -> None:
    """The float32 source GGUF: random N(0, 1/fan_in) matrices, unit norms, the default tokenizer; with `raw`
    (a ggml type name) every matrix is random valid blocks of that type instead."""
    import gguf

    from slipstream.weights import default_model_path
    src = gguf.GGUFReader(default_model_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random-llama-{hidden}x{layers}")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, field in src.fields.items():   # the tokenizer and chat template, as the default model has them
        if not key.startswith("tokenizer."):
            continue
        value, kind = field.contents(), field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, kind, sub_type=sub)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def mat(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32)

    def put(name: str, a: np.ndarray) -> None:   # a matrix, as float32 or (raw) as blocks of that type
        if raw is None:
            w.add_tensor(name, a)
            return
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from support import random_blocks
        qt = gguf.GGMLQuantizationType[raw]
        n, k = a.shape
        w.add_tensor(name, random_blocks(int(qt), n, k, seed=int(rng.integers(1 << 30)), size=2.5 / np.sqrt(k)),
                     raw_dtype=qt)

    put("token_embd.weight", mat(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        put(f"blk.{i}.attn_q.weight", mat(heads * head_dim, hidden))
        put(f"blk.{i}.attn_k.weight", mat(kv_heads * head_dim, hidden))
        put(f"blk.{i}.attn_v.weight", mat(kv_heads * head_dim, hidden))
        put(f"blk.{i}.attn_output.weight", mat(hidden, heads * head_dim))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        put(f"blk.{i}.ffn_gate.weight", mat(ffn, hidden))
        put(f"blk.{i}.ffn_up.weight", mat(ffn, hidden))
        put(f"blk.{i}.ffn_down.weight", mat(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q6_K"])
    ap.add_argument("--raw", nargs="*", default=[], help="ggml types to write every matrix in directly (random blocks)")
    ap.add_argument("--out", default=os.path.expanduser("~/.cache/slipstream/kquant"))
    a = ap.parse_args()
    if a.hidden % 256 or a.ffn % 256:
        raise SystemExit("--hidden and --ffn must be multiples of 256 (the K-quants' super-block)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"random-llama-{a.hidden}x{a.layers}"
    for t in a.raw:
        p = out / f"{stem}.{t}-raw.gguf"
        write_f32(p, a.hidden, a.layers, a.ffn, a.heads, a.kv_heads, a.seed, raw=t)
        print(f"{t}\t{p}\t{p.stat().st_size / 1e6:.1f} MB", flush=True)
    if a.raw and a.types == ap.get_default("types"):
        return 0
    f32 = out / f"{stem}.F32.gguf"
    if not f32.exists():
        write_f32(f32, a.hidden, a.layers, a.ffn, a.heads, a.kv_heads, a.seed)
    for t in a.types:
        p = requantize(str(f32), t, out / f"{stem}.{t}.gguf")
        print(f"{t}\t{p}\t{p.stat().st_size / 1e6:.1f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
