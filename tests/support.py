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
               12: (0, 2), 13: (0, 2), 14: (208,), 23: (0,),
               16: (0,), 17: (0,), 22: (0,), 18: (0,), 21: (0,), 19: (0,), 34: (52,), 35: (64,)}   # IQ1-3, TQ
_CODE_RANGE = {2: 8, 3: 15, 6: 16, 7: 31, 8: 127, 20: 127, 10: 45, 11: 128, 12: 945, 13: 1953, 14: 4064, 23: 4064,
               16: 167, 17: 167, 22: 167, 18: 481, 21: 481, 19: 17, 34: 1, 35: 2, 29: 17, 39: 6}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0, size: float = 0.0):
    """[n, row bytes] uint8: valid ggml blocks of `qtype` built by hand (random codes and scale
    bytes, random sane fp16 scales), for the types gguf-py cannot quantize. With `size`, weights are
    of about that magnitude (the offsets of types with a minimum too)."""
    import gguf
    import numpy as np
    rng = np.random.default_rng(seed)
    qk, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    b = rng.integers(0, 256, size=(n, k // qk, bb), dtype=np.uint8)
    if qtype == 39:   # MXFP4: one power-of-two exponent byte per block (e8m0), codes up to 12 x 2^(e - 128)
        b[..., 0] = rng.integers(-2, 1, size=(n, k // qk)) + int(np.floor(np.log2((size or 1e-2) / 12))) + 128
        return b.reshape(n, -1)
    if qtype == 29:   # IQ1_M: the block's fp16 scale is the top nibbles of its four 16-bit sub-scale words
        d = (rng.uniform(0.5, 1.0, size=(n, k // qk)) * (size or 1e-2) / _CODE_RANGE[qtype]).astype(np.float16)
        bits = d.view(np.uint16).astype(np.uint16)
        words = b[..., 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for j in range(4):
            words[..., j] |= ((bits >> np.uint16(4 * j)) & np.uint16(15)) << np.uint16(12)
        b[..., 48:56] = words.view(np.uint8)
        return b.reshape(n, -1)
    for i, off in enumerate(_F16_FIELDS[qtype]):
        if size:
            d = rng.uniform(0.5, 1.0, size=(n, k // qk)) * size / _CODE_RANGE[qtype]
        else:
            d = rng.uniform(0.5, 2.0, size=(n, k // qk)) * 10.0 ** rng.integers(-4, -1, size=(n, k // qk))
        if i == 0:
            d *= rng.choice([-1.0, 1.0], size=d.shape)
        b[..., off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(n, k // qk, 2)
    return b.reshape(n, -1)


# the KV-cache element-type tests' batch of four prompts (lengths 3, 7, 1 and 7) for teacher_forced
CACHE_PROMPTS = [[1, 22, 333], [5, 6, 7, 8, 9, 10, 11], [42], [1, 504, 3458, 282, 4649, 30, 17]]


def teacher_forced(model, prompts: list[list[int]], runs: dict, steps: int) -> dict:
    """Logits per decode step of the eager step and of native steps, all fed the eager step's greedy tokens.
    `runs`: name -> (exact, KV dtype) with exact None for the eager step (which must be named "eager"); every
    run's prompts are prefilled eagerly into its own cache. -> name -> [steps] of [len(prompts), vocab]."""
    from slipstream.kv.blocks import SequenceKV
    from slipstream.runtime.cpu_team import CpuTeamDecoder
    kv = {n: model.new_kv_cache(64, dtype=dt) for n, (_, dt) in runs.items()}
    teams = {n: CpuTeamDecoder(model, kv[n], exact=bool(ex)) for n, (ex, _) in runs.items() if ex is not None}
    seqs = {n: [SequenceKV(kv[n]) for _ in prompts] for n in runs}
    tokens: list[int] = []
    for n in runs:
        outs = [model.forward(prefill_step(s, p, extra=steps + 2), kv[n]) for p, s in zip(prompts, seqs[n])]
        if n == "eager":
            tokens = [int(o.argmax()) for o in outs]
    positions = [len(p) for p in prompts]
    out: dict = {n: [] for n in runs}
    for _ in range(steps):
        le = model.forward(decode_step(seqs["eager"], tokens, positions), kv["eager"])
        out["eager"].append(le)
        for n, team in teams.items():
            out[n].append(team.forward(decode_step(seqs[n], tokens, positions)))
        tokens = le.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    return out


def assert_flips_only_at_near_ties(ref: list, a: list, b: list, what: str, gap: float = 1.0, slack: int = 3) -> None:
    """Greedy picks of two runs (per step, [rows, vocab] logits) agree except where the reference's top two
    are within `gap`, and at most `slack` times in all."""
    agree = total = 0
    for le, la, lb in zip(ref, a, b):
        for r in range(le.shape[0]):
            total += 1
            if int(la[r].argmax()) == int(lb[r].argmax()):
                agree += 1
                continue
            top = le[r].topk(2).values
            assert (top[0] - top[1]).item() < gap, f"{what} disagree where the reference is no tie"
    assert agree >= total - slack, (agree, total)


def check_native_step_against(hf, model, vocab: int, tokens: int, chunks: tuple[int, ...], exact: bool,
                              num_blocks: int = 16, kv_dtype=None) -> None:
    """A family on the native CPU step against transformers' `hf` on the same weights: the first
    `chunks[-1]` of `tokens` random tokens as prompt chunks ending at each of `chunks` (rows of the
    step), the rest as decode steps. The exact path stays within float32 noise (2e-4) with the same
    greedy tokens; the fast path (int8 activations) stays close and may flip only near ties of a random
    model, never pick a clearly worse token. `kv_dtype`: the cache's element type (default: the model's)."""
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
    kv = model.new_kv_cache(num_blocks=num_blocks, block_size=4, **({"dtype": kv_dtype} if kv_dtype else {}))
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


# -- the families' tiny models against transformers (tests/models, test_model_info) ------------------

def random_hf_model(cls, config, seed: int, norm: float = 1.0, bias: float | None = None):
    """transformers' `cls(config)` in float32 with eager attention, every parameter re-drawn from
    `seed` in `named_parameters` order (logits of order 1, so greedy choices are not near-ties): norm
    weights `norm` + 0.2 N(0, 1) (0 for Gemma's (1 + w) norms), biases `bias` N(0, 1) where given (drawn
    as the other weights otherwise), other weights N(0, 1) / sqrt(fan-in). Its generate() runs to
    max_new_tokens (no EOS) and pads with token 0."""
    import torch
    config._attn_implementation = "eager"
    model = cls(config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(norm + 0.2 * torch.randn(p.shape, generator=g))
            elif bias is not None and name.endswith("bias"):
                p.copy_(bias * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class GGUFFromHF:
    """A tiny GGUF written from a transformers model `hf` the way llama.cpp's converters write one: the
    header keys every family has (with `head_dims` the key/value lengths too; the caller adds its
    own through `.w`), tensors quantized by role (`quant`: the part of the name before ".weight";
    vectors and other roles stay float32), and each quantized weight's dequantized values copied back
    into `hf`, so that both compute on the same numbers. `close(extra)` writes the file, `extra(w)`
    adding more metadata first (a tokenizer)."""

    def __init__(self, hf, path, arch: str, quant: dict, head_dims: bool = True):
        import gguf
        import numpy as np
        self.config = c = hf.config
        self.w = w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(c.num_hidden_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        if head_dims:
            w.add_key_length(c.head_dim)
            w.add_value_length(c.head_dim)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_vocab_size(c.vocab_size)
        self.quant = quant
        self.params = dict(hf.named_parameters())
        self.state = {n: p.detach().numpy().astype(np.float32) for n, p in self.params.items()}

    def put(self, dst: str, arr, back: str | None = None):
        """Write `arr` as tensor `dst`; returns its (dequantized) values as a tensor, also copied into
        the HF parameter `back` where given."""
        import gguf
        import numpy as np
        import torch
        role = dst.split(".")[-2] if dst.startswith("blk.") else dst.split(".")[0]
        qt = self.quant.get(role, gguf.GGMLQuantizationType.F32)
        if qt == gguf.GGMLQuantizationType.F32 or arr.ndim == 1:
            self.w.add_tensor(dst, arr)
            return torch.from_numpy(arr)
        raw = gguf.quants.quantize(arr, qt)
        self.w.add_tensor(dst, raw, raw_dtype=qt)
        deq = torch.from_numpy(gguf.quants.dequantize(raw, qt).reshape(arr.shape).astype(np.float32))
        if back is not None:
            with torch.no_grad():
                self.params[back].copy_(deq)
        return deq

    def put_params(self, layer_names: dict[str, str], norm_offset: float = 0.0) -> None:
        """The embedding, final norm, LM head (when not tied) and each layer's `layer_names` (HF name
        within the layer -> GGUF role), norms stored plus `norm_offset` (1 for Gemma's (1 + w))."""
        c = self.config
        names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
        if not c.tie_word_embeddings:
            names["lm_head.weight"] = "output.weight"
        for i in range(c.num_hidden_layers):
            for src, dst in layer_names.items():
                names[f"model.layers.{i}.{src}.weight"] = f"blk.{i}.{dst}.weight"
        for src, dst in names.items():
            arr = self.state[src]
            self.put(dst, arr + norm_offset if norm_offset and "norm" in dst else arr, back=src)

    def close(self, extra=None) -> None:
        if extra is not None:
            extra(self.w)
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def gguf_tokenizer(w) -> None:
    """A byte-level BPE vocabulary of 96 tokens (printable ASCII, then BOS and EOS), no merges: what
    a tiny family GGUF needs to run through `LLM` or `slipstream inspect`."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(0x21 + i) for i in range(94)] + ["<s>", "</s>"])
    w.add_token_types([1] * 94 + [3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(94)
    w.add_eos_token_id(95)


def tiny_llama_gguf(path, types: dict, ffn: int = 256, size: float = 0.05, seed: int = 0, floats: str = "float32"):
    """A one-layer llama GGUF of hidden size 256 with the 96-token vocabulary (`gguf_tokenizer`), runnable by `LLM`
    and the CLI: the tensors named in `types` ("token_embd", "blk.0.ffn_down", ...) as random valid blocks of that
    ggml type (`random_blocks`, magnitude `size`), the other matrices N(0, size^2) stored as `floats` (float32 or
    float16: an F16 file), unit norms."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(block_count=1, context_length=64, embedding_length=256, feed_forward_length=ffn,
                           head_count=4, head_count_kv=4, vocab_size=96).items():
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-6)
    gguf_tokenizer(w)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd": (96, 256), "blk.0.attn_q": (256, 256), "blk.0.attn_k": (256, 256),
              "blk.0.attn_v": (256, 256), "blk.0.attn_output": (256, 256), "blk.0.ffn_gate": (ffn, 256),
              "blk.0.ffn_up": (ffn, 256), "blk.0.ffn_down": (256, ffn)}
    for name, (n, k) in shapes.items():
        if name in types:
            qt = gguf.GGMLQuantizationType(int(types[name]))
            w.add_tensor(name + ".weight", random_blocks(int(qt), n, k, size=size), raw_dtype=qt)
        else:
            w.add_tensor(name + ".weight", (rng.standard_normal((n, k)) * size).astype(floats))
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        w.add_tensor(name + ".weight", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_and_ours(hf, root, fmt: str, write_gguf):
    """(hf, our model on the same weights): from a Hugging Face folder saved under `root` (`fmt` "hf"),
    or from the GGUF `write_gguf(path)` writes there (which gives `hf` the file's dequantized weights)."""
    from slipstream.models import build_model
    from slipstream.weights.gguf import load_gguf
    from slipstream.weights.safetensors import load_hf
    if fmt == "hf":
        hf.save_pretrained(root, safe_serialization=True)
        cfg, weights = load_hf(root)
    else:
        write_gguf(root / "m.gguf")
        cfg, weights, _ = load_gguf(root / "m.gguf")
    return hf, build_model(cfg, weights)


def forward_chunk(model, kv, seq, start: int, toks: list[int], all_rows: bool = False):
    """Logits of `toks` at positions start.. of `seq` (a `SequenceKV`), as one step: the last row's, or
    every row's."""
    from slipstream.step import StepBuilder
    seq.reserve(start + len(toks))
    b = StepBuilder()
    b.add(seq, toks, start, logits="all" if all_rows else "last")
    return model.forward(b.build(), kv)


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' generate(do_sample=False) continuation of `prompt`. The mask is explicit:
    generate() would otherwise take a prompt token equal to the pad id for padding."""
    import torch
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def check_greedy_matches_generate(hf, model, vocab: int, new_tokens: int, prompt: int = 5, seed: int = 6) -> None:
    """Greedy decoding on the eager step (a prefill, then one decode step per token) gives
    transformers' generate(do_sample=False) tokens for a random prompt."""
    import torch

    from slipstream.kv.blocks import SequenceKV
    toks = torch.randint(0, vocab, (prompt,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        gen = hf.generate(torch.tensor([toks]), max_new_tokens=new_tokens, do_sample=False)[0, prompt:].tolist()
    kv = model.new_kv_cache(num_blocks=8, block_size=4)
    seq = SequenceKV(kv)
    logits = forward_chunk(model, kv, seq, 0, toks)
    ours = []
    for i in range(new_tokens):
        ours.append(int(logits[0].argmax()))
        logits = forward_chunk(model, kv, seq, prompt + i, [ours[-1]])
    assert ours == gen
