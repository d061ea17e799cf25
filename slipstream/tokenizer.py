"""Tokenizer: text <-> token ids, chat templates and streaming detokenization.

A model brings its tokenizer in one of two shapes:

* a GGUF file, which stores the vocabulary under llama.cpp's ``tokenizer.ggml.*`` keys and no
  ``tokenizer.json``; we rebuild an equivalent `tokenizers` pipeline from those keys
  (`Tokenizer.from_gguf`);
* a Hugging Face folder with ``tokenizer.json`` (+ ``tokenizer_config.json``,
  ``generation_config.json``), loaded as is (`Tokenizer.from_hf_dir`).

Both end up as one `tokenizers.Tokenizer` (Rust, fast) plus the few facts the engine needs:
BOS handling, the set of ids that end generation, and the chat template.

Behaviour is meant to match transformers' tokenizer for the same source, with deliberate
exceptions where transformers' GGUF conversion disagrees with the model's own tokenizer (and with
llama.cpp): see `_BYTE_LEVEL_PRE` and `_LLAMA3_FAMILY` below.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

if TYPE_CHECKING:
    import gguf

__all__ = ["Tokenizer", "IncrementalDetokenizer"]

# llama.cpp token types (gguf.TokenType); only these four change how we build the tokenizer.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# Pre-tokenizer split regexes, named after `tokenizer.ggml.pre`. They are the regexes of each
# model's own tokenizer.json (the ones llama.cpp also implements). None of them is copied from
# transformers; transformers only knows some of these names (it has no entry for `smollm`).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# "gpt2": ByteLevel's built-in GPT-2 split. "digits": every digit on its own first, then the GPT-2
# split (SmolLM/StarCoder's tokenizer.json: Digits(individual_digits) + ByteLevel). A tuple: those
# regexes, each applied to the pieces of the one before (like llama.cpp's regex list).
_BYTE_LEVEL_PRE: dict[str, str | tuple[str, ...]] = {
    **dict.fromkeys(["default", "gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"], "gpt2"),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"], "digits"
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "dbrx", "smaug-bpe", "chatglm-bpe"],
        (_LLAMA3_SPLIT,),
    ),
    **dict.fromkeys(
        ["qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan", "megrez", "kormo", "grok-2"], (_QWEN2_SPLIT,)
    ),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], (_GPT4O_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense"], _DEEPSEEK3_SPLITS),
}

# llama.cpp treats these vocabularies as Llama-3-like: a pre-token that is itself a vocabulary
# entry is taken whole (tokenizer.json's `ignore_merges`), and BOS is added unless the file says not.
_LLAMA3_FAMILY = frozenset(
    ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"]
)

# Control tokens that end a turn although the file does not name them as EOS/EOT (llama.cpp does
# the same): e.g. SmolLM2 names <|im_end|> as EOS, but a model may still emit <|endoftext|>.
_END_OF_GENERATION_NAMES = frozenset(
    [
        "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
        "<|end_of_text|>", "<EOT>", "<|return|>", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
    ]
)

# At most this many tokens are held back while the text they spell ends in an incomplete UTF-8
# sequence (a character is at most 4 bytes, i.e. 4 byte tokens); past that the U+FFFD is real.
_MAX_HELD_TOKENS = 6


class Tokenizer:
    """Encodes/decodes text for one model; built with `from_gguf` or `from_hf_dir`."""

    chat_template_source: str | None = None   # where the chat template came from, for people

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: set[int]
    chat_template: str | None

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        vocab_size: int | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        chat_templates: Mapping[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._backend = backend
        self.vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.bos_token_id = self.token_to_id(bos_token)
        eos_id = self.token_to_id(eos_token)
        # add_*_token None means "tokenizer.json's post-processor decides" (HF folders only).
        self._use_post_processor = add_bos_token is None and add_eos_token is None
        self._add_bos = bool(add_bos_token) and self.bos_token_id is not None
        self._add_eos = bool(add_eos_token) and eos_id is not None
        self._eos_id = eos_id
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        # ids that `skip_special_tokens` drops: the added tokens flagged special.
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        ends = set(eos_token_ids)
        if eos_id is not None:
            ends.add(eos_id)
        for i in self.special_token_ids:
            if backend.id_to_token(i) in _END_OF_GENERATION_NAMES:
                ends.add(i)
        self.eos_token_ids = ends
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        if chat_template is not None:
            self.chat_templates.setdefault("default", chat_template)
        self.chat_template = self.chat_templates.get("default", chat_template)
        self._compiled_templates: dict[str, Any] = {}
        # SentencePiece always writes one "▁" in front of the text, even when it already starts
        # with a space; tokenizers' Metaspace skips it then (" hi" -> "▁hi", losing the space).
        # Set for GGUF llama vocabularies with add_space_prefix; see `encode`.
        self._dummy_prefix_for_leading_space = False

    @property
    def dummy_prefix_for_leading_space(self) -> bool:
        """GGUF llama vocabularies with add_space_prefix: a text that starts with a space keeps it."""
        return self._dummy_prefix_for_leading_space

    @dummy_prefix_for_leading_space.setter
    def dummy_prefix_for_leading_space(self, on: bool) -> None:
        self._dummy_prefix_for_leading_space = bool(on)

    @property
    def add_special_tokens(self) -> tuple[bool | None, bool | None]:
        """(add_bos_token, add_eos_token) as this tokenizer was built with them: (None, None) when
        tokenizer.json's post-processor decides (what `Tokenizer(...)` takes back)."""
        if self._use_post_processor:
            return None, None
        return self._add_bos, self._add_eos

    # ---------------------------------------------------------------- construction: GGUF
    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | Mapping[str, Any] | gguf.GGUFReader) -> Tokenizer:
        """Build from a GGUF's ``tokenizer.ggml.*`` metadata: a path, the file's metadata already read
        (key -> value, as `weights.gguf_file.GGUFFile.metadata`) or an open `gguf.GGUFReader`."""
        if isinstance(source, (str, os.PathLike)):
            meta = _read_gguf_metadata(source)
        elif isinstance(source, Mapping):
            meta = source
        else:
            # An already-parsed reader: take its fields instead of reading the file again.
            meta = {k: f.contents() for k, f in source.fields.items() if k.startswith(("tokenizer.", "general."))}
        return cls._from_gguf_metadata(meta)

    @classmethod
    def _from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"tokenizer.ggml.{key}", default)

        kind = get("model")
        # a Sequence (the file reader's `StringArray`: items decoded when read), never copied into a
        # list: see `_bpe_backend`
        tokens: Sequence[str] = get("tokens") or []
        if not len(tokens):
            raise ValueError("GGUF has no tokenizer.ggml.tokens")
        types: list[int] = list(get("token_type") or [_NORMAL] * len(tokens))
        pre = get("pre")

        add_space_prefix = False
        if kind == "gpt2":
            backend, vocab_tokens = _byte_level_bpe(tokens, types, get("merges"), pre)
            default_add_bos = pre in _LLAMA3_FAMILY
        elif kind == "llama":
            add_space_prefix = bool(get("add_space_prefix", True))
            backend, vocab_tokens = _sentencepiece_bpe(
                tokens, types, get("scores"), get("merges"), add_space_prefix, get("unknown_token_id")
            )
            default_add_bos = True  # llama.cpp/sentencepiece default for Llama-style vocabularies
        else:
            raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' and 'llama')")

        def name_of(key: str) -> str | None:
            i = get(key)
            return vocab_tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        named = {k: name_of(f"{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
        # Control tokens are matched whole and dropped by skip_special_tokens; user-defined ones
        # (like <think>) are matched whole but are ordinary text when decoding. The tokens the file
        # names (bos/eos/unk/pad) are special whatever their type, as in transformers.
        named_tokens = {t for t in named.values() if t}
        special = [t for t, ty in zip(vocab_tokens, types) if t and (ty in (_CONTROL, _UNKNOWN) or t in named_tokens)]
        user = [t for t, ty in zip(vocab_tokens, types) if t and ty == _USER_DEFINED and t not in named_tokens]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(special)])
        if user:
            backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in dict.fromkeys(user)])

        templates = {
            k[len("tokenizer.chat_template.") :]: v
            for k, v in meta.items()
            if k.startswith("tokenizer.chat_template.") and isinstance(v, str)
        }
        extra_eos = [int(get(k)) for k in ("eot_token_id", "eom_token_id") if get(k) is not None]
        tok = cls(
            backend,
            vocab_size=len(tokens),
            bos_token=named["bos"],
            eos_token=named["eos"],
            unk_token=named["unknown"],
            pad_token=named["padding"],
            add_bos_token=bool(get("add_bos_token", default_add_bos)),
            add_eos_token=bool(get("add_eos_token", False)),
            eos_token_ids=extra_eos,
            chat_template=meta.get("tokenizer.chat_template"),
            chat_templates=templates,
        )
        tok._dummy_prefix_for_leading_space = kind == "llama" and add_space_prefix
        if tok.chat_template is not None:
            tok.chat_template_source = "the file's tokenizer.chat_template"
        else:   # as llama.cpp does: the family's known format, recognised by its chat tokens
            from slipstream.chat_templates import family_template

            found = family_template(vocab_tokens)
            if found is not None:
                tok.chat_template = tok.chat_templates["default"] = found[1]
                tok.chat_template_source = f"built-in {found[0]} template (the file has none)"
        return tok

    # ---------------------------------------------------------------- construction: HF folder
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` plus the settings transformers keeps beside it."""
        root = Path(path)
        backend = _HFTokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        special_map = _read_json(root / "special_tokens_map.json")
        generation = _read_json(root / "generation_config.json")

        def token(name: str) -> str | None:
            value = config.get(name, special_map.get(name))
            if isinstance(value, dict):  # serialized AddedToken
                value = value.get("content")
            return value if isinstance(value, str) else None

        # tokenizer.json's post-processor decides what encode() adds (e.g. Llama 3's
        # <|begin_of_text|>); transformers 5 ignores tokenizer_config's add_bos/add_eos_token when
        # it has one (its save_pretrained writes the flags into it). Only a file without a
        # post-processor falls back to the flags, as older transformers and llama.cpp did.
        flags = backend.post_processor is None
        templates = _hf_chat_templates(root, config)

        eos_ids: list[int] = []
        gen_eos = generation.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos_ids.append(gen_eos)
        elif isinstance(gen_eos, list):
            eos_ids.extend(int(i) for i in gen_eos)

        tok = cls(
            backend,
            bos_token=token("bos_token"),
            eos_token=token("eos_token"),
            unk_token=token("unk_token"),
            pad_token=token("pad_token"),
            add_bos_token=bool(config.get("add_bos_token", False)) if flags else None,
            add_eos_token=bool(config.get("add_eos_token", False)) if flags else None,
            eos_token_ids=eos_ids,
            chat_templates=templates,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )
        if tok.bos_token_id is None and isinstance(generation.get("bos_token_id"), int):
            tok.bos_token_id = generation["bos_token_id"]
        return tok

    # ---------------------------------------------------------------- basic conversions
    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in the text (e.g. "<|im_start|>") are matched
        whole. With `add_special_tokens`, BOS (and EOS) are added when the model asks for them."""
        if self._dummy_prefix_for_leading_space and text.startswith(" "):
            text = " " + text  # Metaspace turns "  hi" into "▁▁hi", as SentencePiece does " hi"
        if self._use_post_processor:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self._add_eos:
                ids.append(self._eos_id)  # type: ignore[arg-type]
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one generated sequence."""
        return IncrementalDetokenizer(self, skip_special_tokens)

    # ---------------------------------------------------------------- chat template
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` to the prompt string, as transformers' `apply_chat_template(...,
        tokenize=False)` does. `chat_template` may be a template or the name of one the model has
        (e.g. "tool_use"); extra `kwargs` are visible to the template (e.g. enable_thinking)."""
        source = self._pick_template(chat_template, tools)
        template = self._compiled_templates.get(source)
        if template is None:
            template = self._compiled_templates[source] = _compile_chat_template(source)
        chat = [_alias_reasoning(dict(m)) for m in messages]
        if continue_final_message and not chat:
            raise ValueError("continue_final_message needs a final message to continue")
        variables: dict[str, Any] = {
            name: value
            for name, value in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
            )
            if value is not None
        }
        variables.update(kwargs)  # caller's values win, as in transformers
        rendered = template.render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            **variables,
        )
        if continue_final_message:
            # Cut after the final message's text so generation continues it (drops the end-of-turn).
            final = chat[-1].get("content")
            if isinstance(final, list):
                final = next((b.get("text") for b in reversed(final) if isinstance(b, dict) and "text" in b), None)
            if not isinstance(final, str) or final.strip() not in rendered:
                raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
            stripped = final.strip()
            end = rendered.rindex(stripped) + len(stripped)
            if rendered[end : end + len(final) - len(final.rstrip())] == final[len(final.rstrip()) :]:
                end += len(final) - len(final.rstrip())  # keep the message's own trailing spaces
            rendered = rendered[:end]
        return rendered

    def _pick_template(self, chat_template: str | None, tools: Any) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        return self.chat_template


class IncrementalDetokenizer:
    """Turns generated ids into text one token at a time.

    Decoding each token on its own is wrong twice over: a token can hold part of a UTF-8
    character (byte-level BPE, byte-fallback tokens), and SentencePiece decoders strip the leading
    space of whatever they decode first. So we decode a short window that starts at an
    already-emitted token and emit only the difference, and hold text back while it ends in an
    incomplete character. The concatenation of everything `add` and `flush` return equals
    `tokenizer.decode(all_ids, skip_special_tokens)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Dropping skipped ids up front keeps windows starting at a real token, so a leading-space
        # strip in the decoder never eats the space after a skipped special token.
        self._drop = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._prefix = 0  # window start: first token of the last emitted step
        self._read = 0  # tokens before this index have been emitted
        self.text = ""

    def add(self, token_id: int) -> str:
        """Feed one id; returns the text it finalised (may be "")."""
        if token_id in self._drop:
            return ""
        self._ids.append(token_id)
        return self._step(final=False)

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Everything still held back (an incomplete character at the very end)."""
        return self._step(final=True) if self._read < len(self._ids) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _step(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        if not final and after.endswith("\ufffd") and held < _MAX_HELD_TOKENS:
            return ""  # probably a character split across tokens: wait for the rest
        # `before` is normally a prefix of `after`; if a decoder rewrote it, keep what is new.
        delta = after[len(before) :] if after.startswith(before) else after[_common_prefix(before, after) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta


# -------------------------------------------------------------------- GGUF -> tokenizers


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies:
    printable Latin-1 bytes stand for themselves, the rest are moved to U+0100 and up."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


class _ByteLevelSpelling(Sequence[str]):
    """A `gpt2` GGUF vocabulary as byte-level BPE spells it, each entry respelled when it is read.

    Entries are spelled in the byte alphabet. A rare converter writes a normal token as raw text:
    respell it. Control/user-defined tokens stay raw, so that registering them as added tokens maps
    onto their existing id instead of creating a new one."""

    def __init__(self, tokens: Sequence[str], types: Sequence[int]) -> None:
        self._tokens, self._types = tokens, types
        self._table = gpt2_byte_alphabet()
        self._alphabet = frozenset(self._table.values())

    def _spell(self, t: str, ty: int) -> str:
        if ty in (_CONTROL, _USER_DEFINED) or self._alphabet.issuperset(t):
            return t
        return "".join(self._table[b] for b in t.encode("utf-8"))

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._spell(self._tokens[i], self._types[i])

    def __iter__(self) -> Iterator[str]:
        return (self._spell(t, ty) for t, ty in zip(self._tokens, self._types))


def _bpe_backend(vocab: Iterable[str], merges: Iterable[Sequence[str]], **options: Any) -> _HFTokenizer:
    """A `tokenizers` BPE model over `vocab` (the i-th string is token i; a repeated string keeps its
    first id) and the ranked `merges` ("left right" or (left, right)).

    `models.BPE` takes the whole vocabulary and merges as Python objects (~100k small strings for
    SmolLM2). They live only inside this function, and only the model's own object is made while
    they exist: a long-lived object allocated among them keeps its 1 MB allocator arena resident
    after they are freed (~7 MB of them when the vocabulary lists lived through the whole load)."""
    ids: dict[str, int] = {}
    for i, t in enumerate(vocab):
        ids.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    model = models.BPE(ids, pairs, **options)
    del ids, pairs
    return _HFTokenizer(model)


def _byte_level_bpe(
    tokens: Sequence[str], types: Sequence[int], merges: Sequence[str] | None, pre: str | None
) -> tuple[_HFTokenizer, Sequence[str]]:
    """GPT-2-style byte-level BPE from a `gpt2` GGUF vocabulary (and the vocabulary as it spells it)."""
    vocab_tokens = _ByteLevelSpelling(tokens, types)
    backend = _bpe_backend(vocab_tokens, merges or (), ignore_merges=pre in _LLAMA3_FAMILY)

    scheme = _BYTE_LEVEL_PRE.get(pre or "default", "gpt2")  # unknown names: plain GPT-2 split
    if scheme == "gpt2":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif scheme == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in scheme]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    return backend, vocab_tokens


def _sentencepiece_bpe(
    tokens: Sequence[str],
    types: Sequence[int],
    scores: Sequence[float] | None,
    merges: Sequence[str] | None,
    add_space_prefix: bool,
    unk_id: int | None,
) -> tuple[_HFTokenizer, Sequence[str]]:
    """SentencePiece BPE (Llama/Mistral-style vocabulary) as a `tokenizers` BPE with byte fallback.

    SentencePiece BPE merges, at each step, the adjacent pair whose concatenation is the
    highest-scoring vocabulary piece. A ranked merge list reproduces that when pairs are ranked by
    the score of the piece they make, which is how we build merges when the file has none.
    """
    pairs: Iterable[Sequence[str]] = merges if merges else _merges_from_scores(tokens, types, scores)
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = _bpe_backend(tokens, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    del pairs
    # Spaces become "▁"; with add_space_prefix, one is put in front of the text: only at its very
    # start, not after every special token (transformers' "first" scheme; llama.cpp adds one after
    # each special token too). Text starting with a space gets its "▁" in `Tokenizer.encode`.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # undo the prefix space
    backend.decoder = decoders.Sequence(steps)
    return backend, tokens


def _merges_from_scores(
    tokens: Sequence[str], types: Sequence[int], scores: Sequence[float] | None
) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal piece into two vocabulary pieces, best score first.

    Ties (equal scores) go to the piece with the lower id; two splits of one piece can never both
    be available at once, so their relative order does not matter."""
    if scores is None:
        scores = [-float(i) for i in range(len(tokens))]  # no scores: earlier pieces merge first
    index: dict[str, int] = {}
    for i, t in enumerate(tokens):
        index.setdefault(t, i)
    ranked: list[tuple[float, int, str, str]] = []
    for i, (piece, ty) in enumerate(zip(tokens, types)):
        # Only normal pieces are made by merging: control/byte/user-defined tokens never are.
        if ty != _NORMAL or len(piece) < 2 or index[piece] != i:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                ranked.append((-float(scores[i]), i, left, right))
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [(left, right) for _, _, left, right in ranked]


# -------------------------------------------------------------------- GGUF metadata reader


def _read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (v2/v3), without touching the tensors.

    `gguf.GGUFReader` parses every tensor record and wraps each array element in numpy, which
    takes seconds on a full vocabulary; this reads only the header (`weights/gguf_file.py`)."""
    from slipstream.weights.gguf_file import read_metadata

    return read_metadata(path)


# -------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _hf_chat_templates(root: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Chat templates of an HF folder: chat_template.jinja (current transformers), the older
    chat_template.json, or tokenizer_config.json's `chat_template` (a string or a named list)."""
    templates: dict[str, str] = {}
    value = config.get("chat_template")
    if isinstance(value, str):
        templates["default"] = value
    elif isinstance(value, list):
        templates.update({t["name"]: t["template"] for t in value if "name" in t and "template" in t})
    legacy = _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(legacy, str):
        templates["default"] = legacy
    for extra in sorted((root / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text(encoding="utf-8")
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        templates["default"] = jinja.read_text(encoding="utf-8")
    return templates


def _compile_chat_template(source: str) -> Any:
    """A jinja2 template in the environment chat templates are written for (transformers'
    conventions): sandboxed, trim_blocks + lstrip_blocks, loop controls, a `tojson` that does not
    HTML-escape, and the `raise_exception` / `strftime_now` helpers."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """Templates read a message's reasoning under different names (Qwen: reasoning_content,
    gpt-oss: thinking; OpenAI-style clients send reasoning); make all of them present."""
    value = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if value is not None:
        for k in ("reasoning_content", "thinking"):
            message.setdefault(k, value)
    return message


def _clean_up_spaces(text: str) -> str:
    """The old BERT-era detokenization cleanup, for folders whose config asks for it."""
    for before, after in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
        (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
