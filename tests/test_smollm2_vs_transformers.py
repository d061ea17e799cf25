"""Headline correctness: Slipstream on the embedded SmolLM2-135M-Instruct Q4_1 GGUF against
Hugging Face transformers on the very same file.

transformers dequantizes the GGUF to float32 and runs its own Llama implementation; Slipstream keeps
the weights packed and runs its own kernels. Both see identical prompt ids (Slipstream's tokenizer,
chat template rendered with add_generation_prompt), so any difference is in the model maths.

Oracle for greedy decoding: *teacher forcing*. One transformers forward over prompt + the 64 tokens
Slipstream generated gives transformers' next-token logits at every generated position, conditioned
on exactly the prefix Slipstream had. Greedy decoding in transformers produces the same ids if and
only if each generated token is the argmax there, so this is equivalent to transformers' own greedy
loop, and a mismatch points at the exact position instead of cascading (a genuine tie, where
transformers' own top two logits are within its numerical noise, is not counted). The literal check
is there too: transformers' incremental greedy loop (past_key_values) must give the same 64 ids.
The same logits are the reference for

* prefill logits (`LlamaModel.forward`, every prompt position, not only the last), and
* decode-step logits of the native CPU runtime's exact path (`CpuTeamDecoder(exact=True)`, all 8
  sequences batched, fed the
  greedy tokens one step at a time over the paged KV cache the prefill filled; the first
  `DECODE_STEPS` steps: the greedy test already covers the argmax at all 64).

Tolerance: max |logit difference| <= 1e-3 on logits of magnitude ~15-30 (measured: ~1e-4).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from slipstream import LLM, SamplingParams  # noqa: E402
from slipstream.errors import ModelLoadError  # noqa: E402
from slipstream.kernels.cpu import load_library  # noqa: E402
from slipstream.kv.blocks import SequenceKV  # noqa: E402
from slipstream.step import decode_step, prefill_step  # noqa: E402
from slipstream.weights import default_model_path  # noqa: E402

MAX_TOKENS = 64
LOGIT_ATOL = 1e-3
# A position where transformers' own top two logits are closer than this is a genuine tie: its
# incremental and full-sequence forwards already disagree by ~5e-5, so either choice is greedy.
TIE_EPS = 2e-4

CHATS = {
    "chat_fact": [{"role": "user", "content": "What is the capital of France?"}],
    "chat_haiku": [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    "chat_explain": [{"role": "user", "content": "Explain recursion to a child in two sentences."}],
    "chat_multiturn": [
        {"role": "system", "content": "You are a pirate who answers briefly."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Arr, ahoy matey!"},
        {"role": "user", "content": "What do you eat on the ship, and how many barrels do you carry?"},
    ],
}
RAWS = {
    "raw_code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "raw_list": "Shopping list for the week:\n1. eggs\n2. milk\n3.",
    "raw_prose": (
        "The old lighthouse keeper climbed the one hundred and twelve stairs every evening at "
        "dusk. For thirty-one years he had lit the lamp, wound the clockwork and logged the ships "
        "that passed in the night. On the last evening of October, as the fog rolled in from the "
        "sea,"
    ),
    "raw_question": "Question: Why is the sky blue during the day but red at sunset?\nAnswer:",
}
NAMES = list(CHATS) + list(RAWS)


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hf(gguf_path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(gguf_path) -> LLM:
    return LLM(exact=True)  # the native CPU runtime where available, on its exact (fp32-activation) path


@pytest.fixture(scope="module")
def llm_eager(gguf_path) -> LLM:
    # the torch reference; small prefill chunks so chunked prefill is compared with transformers too
    return LLM(runtime="eager", prefill_chunk=16)


@pytest.fixture(scope="module")
def prompts(llm) -> dict[str, list[int]]:
    tok = llm.tokenizer
    out = {}
    for name, messages in CHATS.items():
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
        out[name] = tok.encode(text, add_special_tokens=False)  # as LLM.chat does
    for name, text in RAWS.items():
        out[name] = tok.encode(text)
    return out


def _greedy(model: LLM, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = model.generate([prompts[n] for n in NAMES], params)  # all 8 in one batch
    for n, o in zip(NAMES, outs):
        assert o.prompt_token_ids == prompts[n]
        assert len(o.token_ids) == MAX_TOKENS and o.finish_reason == "length"
    return {n: o.token_ids for n, o in zip(NAMES, outs)}


@pytest.fixture(scope="module")
def greedy(llm, llm_eager, prompts) -> dict[str, dict[str, list[int]]]:
    return {"default": _greedy(llm, prompts), "eager": _greedy(llm_eager, prompts)}


@pytest.fixture(scope="module")
def hf_logits(hf):
    """transformers' logits at every position of a token sequence (cached per sequence)."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def get(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in cache:
            with torch.inference_mode():
                cache[key] = hf(torch.tensor([ids])).logits[0].float()
        return cache[key]

    return get


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- greedy token ids ------------------------------------------------------------------------------

def test_default_runtime_is_native(llm):
    if load_library() is None:
        pytest.skip("native CPU kernels unavailable: LLM() falls back to eager")
    assert llm.engine.runtime_name == "native"


@pytest.mark.parametrize("runtime", ["default", "eager"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_ids_match_transformers(runtime, name, prompts, greedy, hf_logits):
    prompt, gen = prompts[name], greedy[runtime][name]
    # logits[i] predicts token i + 1: rows len(prompt) - 1 ... predict the generated tokens
    ref = hf_logits(prompt + gen[:-1])[len(prompt) - 1:]
    assert ref.shape[0] == MAX_TOKENS
    best = ref.argmax(-1).tolist()
    bad = []
    for i, (ours, theirs) in enumerate(zip(gen, best)):
        if ours != theirs:
            margin = (ref[i, theirs] - ref[i, ours]).item()
            if margin >= TIE_EPS:
                bad.append(f"step {i}: slipstream {ours}, transformers {theirs} (by {margin:.2g})")
    assert not bad, f"{runtime} greedy differs from transformers on {name}: " + "; ".join(bad)


def test_runtimes_agree(greedy):
    assert greedy["default"] == greedy["eager"]


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts) -> dict[str, list[int]]:
    """transformers' own greedy loop: prefill, then one token at a time over its KV cache."""
    out = {}
    with torch.inference_mode():
        for name in NAMES:
            r = hf(torch.tensor([prompts[name]]), use_cache=True)
            ids: list[int] = []
            for _ in range(MAX_TOKENS):
                ids.append(int(r.logits[0, -1].argmax()))
                r = hf(torch.tensor([[ids[-1]]]), past_key_values=r.past_key_values, use_cache=True)
            out[name] = ids
    return out


@pytest.mark.parametrize("name", NAMES)
def test_greedy_ids_equal_transformers_loop(name, greedy, hf_greedy, prompts, hf_logits):
    """The literal comparison: transformers' incremental greedy loop gives the very same 64 ids."""
    ours, theirs = greedy["default"][name], hf_greedy[name]
    if ours != theirs:
        i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        row = hf_logits(prompts[name] + ours[:i + 1])[-1]
        pytest.fail(f"{name}: first difference at step {i}: slipstream {ours[i]}, transformers {theirs[i]}; "
                    f"transformers' logits there differ by {(row[theirs[i]] - row[ours[i]]).item():.3g}")


# -- logits -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prefilled(llm, prompts):
    """All 8 prompts prefilled by `LlamaModel.forward` into one paged cache (with room for decoding),
    logits kept at every prompt position."""
    model = llm.model
    kv = model.new_kv_cache(sum(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts.values()) + 4)
    seqs, logits = {}, {}
    for name in NAMES:
        ids = prompts[name]
        seq = SequenceKV(kv)
        seq.reserve(len(ids) + MAX_TOKENS)
        seqs[name], logits[name] = seq, model.forward(prefill_step(seq, ids, logits="all"), kv)
    return kv, seqs, logits


@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_match_transformers(name, prompts, prefilled, hf_logits):
    """Prefill logits at the last prompt position, and at every earlier one too."""
    ours = prefilled[2][name]
    ref = hf_logits(prompts[name])
    assert ours.shape == ref.shape
    assert ref[-1].abs().max().item() > 5  # real logits, not a degenerate comparison
    assert _max_diff(ours[-1], ref[-1]) <= LOGIT_ATOL, "last-position logits"
    assert _max_diff(ours, ref) <= LOGIT_ATOL, "logits at some earlier prompt position"


DECODE_STEPS = 24


def test_native_decode_logits_match_transformers(llm, prompts, greedy, prefilled, hf_logits):
    """The 8 prefilled sequences decoded together by the native runtime (exact path), teacher-forced with the greedy
    tokens: every step's logits against transformers' at the same position."""
    if load_library() is None:
        pytest.skip("native CPU kernels unavailable")
    from slipstream.runtime.cpu_team import CpuTeamDecoder

    kv, seqs, _ = prefilled
    native = CpuTeamDecoder(llm.model, kv, exact=True)
    gens = [greedy["default"][n] for n in NAMES]
    ids = [prompts[n] for n in NAMES]
    refs = [hf_logits(p + g[:-1])[len(p):] for p, g in zip(ids, gens)]  # rows predicting g[1:]
    worst, where = 0.0, None
    for t in range(DECODE_STEPS):
        positions = [len(p) + t for p in ids]
        batch = [seqs[n] for n in NAMES]
        step = decode_step(batch, [g[t] for g in gens], positions)
        out = native.forward(step)
        assert out.shape == (len(NAMES), llm.model.cfg.vocab_size)
        for i in range(len(NAMES)):
            d = _max_diff(out[i], refs[i][t])
            if d > worst:
                worst, where = d, (NAMES[i], t + 1)
        assert out.argmax(-1).tolist() == [g[t + 1] for g in gens]
    assert worst <= LOGIT_ATOL, f"native decode logits differ by {worst:.3g} at {where}"
