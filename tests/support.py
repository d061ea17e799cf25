"""Helpers shared by tests in every folder (a uniquely named module: every conftest.py is
imported as `conftest`, so `from conftest import ...` depends on collection order)."""
from __future__ import annotations

import pytest

from slipstream.errors import ModelLoadError
from slipstream.weights import default_model_path


def skip_unless_default_model() -> None:
    """Skip the calling test or fixture when the embedded default model is not installed."""
    try:
        default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


def prefill_step(seq, prompt: list[int], extra: int = 16):
    """A whole prompt as one step into `seq` (a `SequenceKV`, reserved for `extra` more tokens),
    asking for the last position's logits; attention reads gathered slot ids."""
    from slipstream.step import prefill_step as build

    seq.reserve(len(prompt) + extra)
    return build(seq, prompt, gather=True)


def decode_step(seqs: list, tokens: list[int], positions: list[int]):
    """One decode step: token i of sequence i at position i, attending over its gathered slots."""
    from slipstream.step import decode_step as build

    return build(seqs, tokens, positions, gather=True)


def engine(llm, **kw):
    """A fresh `Engine` over an `LLM`'s model and tokenizer, configured by `kw` (`EngineConfig`'s
    fields; 2048 KV tokens and the LLM's CPU path unless given)."""
    from slipstream.engine.config import EngineConfig
    from slipstream.engine.engine import Engine

    kw.setdefault("kv_cache_tokens", 2048)
    kw.setdefault("exact", llm.engine_config.exact)   # the LLM's CPU path (fast or exact)
    return Engine(llm.model, llm.tokenizer, EngineConfig(**kw))


# byte offsets of each ggml block type's fp16 scale fields, and the largest |code x sub-scale| a
# random block can hold (to choose scales that give weights of a wanted size)
_F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 20: (0,), 10: (80, 82), 11: (108,),
               12: (0, 2), 13: (0, 2), 14: (208,), 23: (0,)}
_CODE_RANGE = {2: 8, 3: 15, 6: 16, 7: 31, 8: 127, 20: 127, 10: 45, 11: 128, 12: 945, 13: 1953, 14: 4064, 23: 4064}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0, size: float = 0.0):
    """[n, row bytes] uint8: valid ggml blocks of `qtype` built by hand (random codes and scale
    bytes, random sane fp16 scales), for the types gguf-py cannot quantize. With `size`, weights are
    of about that magnitude (the offsets of types with a minimum too)."""
    import gguf
    import numpy as np
    rng = np.random.default_rng(seed)
    qk, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    b = rng.integers(0, 256, size=(n, k // qk, bb), dtype=np.uint8)
    for i, off in enumerate(_F16_FIELDS[qtype]):
        if size:
            d = rng.uniform(0.5, 1.0, size=(n, k // qk)) * size / _CODE_RANGE[qtype]
        else:
            d = rng.uniform(0.5, 2.0, size=(n, k // qk)) * 10.0 ** rng.integers(-4, -1, size=(n, k // qk))
        if i == 0:
            d *= rng.choice([-1.0, 1.0], size=d.shape)
        b[..., off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(n, k // qk, 2)
    return b.reshape(n, -1)


def check_native_step_against(hf, model, vocab: int, tokens: int, chunks: tuple[int, ...], exact: bool,
                              num_blocks: int = 16) -> None:
    """A family on the native CPU step against transformers' `hf` on the same weights: the first
    `chunks[-1]` of `tokens` random tokens as prompt chunks ending at each of `chunks` (rows of the
    step), the rest as decode steps. The exact path stays within float32 noise (2e-4) with the same
    greedy tokens; the fast path (int8 activations) stays close and may flip only near ties of a random
    model, never pick a clearly worse token."""
    import torch

    from slipstream.kernels.cpu import load_library
    if load_library() is None:
        pytest.skip("native CPU kernels unavailable")
    from slipstream.kv.blocks import SequenceKV
    from slipstream.runtime.cpu_team import CpuTeamDecoder
    from slipstream.step import StepBuilder
    toks = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()
    kv = model.new_kv_cache(num_blocks=num_blocks, block_size=4)
    team = CpuTeamDecoder(model, kv, exact=exact)
    seq = SequenceKV(kv)
    spans = list(zip((0,) + chunks[:-1], chunks)) + [(p, p + 1) for p in range(chunks[-1], tokens)]
    got = []
    for start, end in spans:
        seq.reserve(end)
        b = StepBuilder()
        b.add(seq, toks[start:end], start, logits="all")
        got.append(team.forward(b.build()))
    out = torch.cat(got)
    torch.testing.assert_close(out, ref, atol=2e-4 if exact else 0.15, rtol=0)
    if exact:
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
    else:
        chosen = ref.gather(1, out.argmax(-1, keepdim=True))[:, 0]
        assert (chosen >= ref.max(-1).values - 0.1).all()
