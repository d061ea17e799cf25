"""torch's CPU scaled_dot_product_attention on 3-D against 4-D inputs (a prompt's causal attention, one
layer of SmolLM2's shape: 9 query heads over 3 KV heads, head size 64): the flash kernel takes only 4-D.

    python benchmarks/sdpa_layouts.py [--tokens 512] [--cached 300]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def _ms(f, n: int = 20) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--cached", type=int, default=300, help="tokens before the chunk (the masked case)")
    a = ap.parse_args()
    L, H, KVH, D = a.tokens, 9, 3, 64
    q, k, v = torch.randn(H, L, D), torch.randn(KVH, L, D), torch.randn(KVH, L, D)
    cases = {
        "causal, 3-D": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "causal, 4-D": lambda: F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                              enable_gqa=True),
    }
    n = L + a.cached
    mask = torch.arange(n)[None, :] <= a.cached + torch.arange(L)[:, None]
    k2, v2 = torch.randn(KVH, n, D), torch.randn(KVH, n, D)
    cases["chunk after cached, 3-D"] = lambda: F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask,
                                                                              enable_gqa=True)
    cases["chunk after cached, 4-D"] = lambda: F.scaled_dot_product_attention(q[None], k2[None], v2[None],
                                                                              attn_mask=mask, enable_gqa=True)
    for name, f in cases.items():
        print(f"{name:<26} {_ms(f):7.2f} ms")


if __name__ == "__main__":
    main()
