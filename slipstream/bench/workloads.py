"""The scenarios and their prompts.

* ``short``        prompts asking for a 200-character commentary, sent one after another.
* ``long``         prompts asking for a 3,000-character technical article, one after another.
* ``batch-docs``   summaries of ~800-character documents (cut from the built-in text), all submitted
                   together.
* ``conversation`` a 10-round technical Q&A; every round sends the whole history (system message,
                   the previous questions and the target's own previous answers).
* ``serving``      a sweep over closed-loop concurrency and/or Poisson request rates with prompts of a
                   set token length (``--dataset random``) or built-in document prompts
                   (``--dataset builtin``), every request asking for exactly ``--output-len`` tokens.

Random prompts of ``input_len`` tokens (``--dataset random``) are random words drawn from the
built-in text's vocabulary, cut to length with the server's own tokenizer endpoint when it has one
(``/tokenize`` + ``/detokenize`` of vLLM, SGLang or llama.cpp, ``/extras/tokenize`` of
llama-cpp-python): the chat template's overhead is measured once (a non-streaming request's
``usage.prompt_tokens`` minus the raw text's token count), the word string is tokenized, cut to
``input_len - overhead`` tokens, detokenized, and re-tokenized to record the exact length
(``expected_prompt_tokens``; usually ``input_len``, at most a token or two off where the cut splits
a word). A server without a tokenizer endpoint gets the tokenizer-free fallback: two non-streaming
probes with 100 and 300 words fit tokens = overhead + slope * words from ``usage.prompt_tokens``
and the word count is chosen from that fit (lengths approximate; the actual ones come from
``usage``). The prompts are built once, against the first target, and the same texts are sent to the
peer.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

from slipstream.bench.client import HttpTokenizer, Prompt, Target, complete_once
from slipstream.bench.texts import CONVERSATION, CORPUS, LONG_TOPICS, SHORT_TOPICS, SYSTEM_PROMPT

SCENARIOS = ("short", "long", "batch-docs", "conversation", "serving")

# per scenario: default number of requests and max_tokens per request
DEFAULTS: dict[str, dict[str, int]] = {
    "short": {"num_prompts": 5, "max_tokens": 128},
    "long": {"num_prompts": 2, "max_tokens": 1024},
    "batch-docs": {"num_prompts": 50, "max_tokens": 128},
    "conversation": {"num_prompts": 10, "max_tokens": 128},   # num_prompts = rounds
    "serving": {"num_prompts": 32, "max_tokens": 128},        # max_tokens = --output-len
}


@dataclass
class ScenarioSpec:
    """What to run for one scenario. ``mode``: "sequential" (one request at a time), "batch" (all
    at once), "conversation" (sequential, each round built from the previous answers) or "serving"
    (one run per point of ``points``)."""

    name: str
    mode: str
    prompts: list[Prompt]
    points: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    config: dict[str, Any] = field(default_factory=dict)


def sentences(text: str = CORPUS) -> list[str]:
    flat = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+", flat) if s]


def vocabulary(text: str = CORPUS) -> list[str]:
    return sorted({w.lower() for w in re.findall(r"[A-Za-z]+", text) if len(w) > 1})


def documents(n: int, chars: int = 800, seed: int = 0) -> list[str]:
    """`n` documents of about `chars` characters: runs of consecutive sentences of the built-in
    text, starting at different sentences (cycling), each ending on a sentence boundary."""
    sents = sentences()
    rng = random.Random(seed)
    starts = list(range(len(sents)))
    rng.shuffle(starts)
    docs = []
    for i in range(n):
        j = starts[i % len(starts)] + (i // len(starts))
        out: list[str] = []
        while sum(len(s) + 1 for s in out) < chars * 0.9:
            out.append(sents[j % len(sents)])
            j += 1
        docs.append(" ".join(out))
    return docs


def short_prompts(n: int, max_tokens: int, fixed: bool) -> list[Prompt]:
    return [Prompt([{"role": "user", "content": f"Write a 200-character commentary on {SHORT_TOPICS[i % len(SHORT_TOPICS)]}."}],
                   max_tokens, fixed) for i in range(n)]


def long_prompts(n: int, max_tokens: int, fixed: bool) -> list[Prompt]:
    return [Prompt([{"role": "user", "content": f"Write a 3,000-character technical article on {LONG_TOPICS[i % len(LONG_TOPICS)]}. "
                                                "Use several paragraphs with headings."}],
                   max_tokens, fixed) for i in range(n)]


def doc_prompts(n: int, max_tokens: int, fixed: bool, seed: int = 0) -> list[Prompt]:
    return [Prompt([{"role": "user", "content": f"Summarize the following document (manual {i + 1}) in two or three "
                                                f"sentences.\n\n{doc}"}], max_tokens, fixed)
            for i, doc in enumerate(documents(n, 800, seed))]


def conversation_turns(rounds: int) -> list[str]:
    return [CONVERSATION[i % len(CONVERSATION)] for i in range(rounds)]


def conversation_prompt(history: list[dict[str, str]], max_tokens: int, fixed: bool) -> Prompt:
    return Prompt([{"role": "system", "content": SYSTEM_PROMPT}] + list(history), max_tokens, fixed)


def random_words(n: int, rng: random.Random, vocab: list[str] | None = None) -> str:
    vocab = vocab or vocabulary()
    return " ".join(rng.choice(vocab) for _ in range(n))


async def template_overhead(client: httpx.AsyncClient, target: Target, tok: HttpTokenizer | None) -> int | None:
    """Prompt tokens the server adds around a message (chat template, BOS): a non-streaming
    request's usage.prompt_tokens minus the raw text's own token count."""
    if tok is None or tok.kind is None:
        return None
    text = "The quick brown fox jumps over the lazy dog"
    ids = await tok.tokenize(text)
    status, body = await complete_once(client, target, Prompt([{"role": "user", "content": text}], 1))
    usage = body.get("usage") if isinstance(body, dict) else None
    if ids is None or status != 200 or not isinstance(usage, dict) or usage.get("prompt_tokens") is None:
        return None
    return max(0, int(usage["prompt_tokens"]) - len(ids))


async def build_random_prompts(client: httpx.AsyncClient, target: Target, tok: HttpTokenizer | None, n: int,
                               input_len: int, output_len: int, seed: int) -> tuple[list[Prompt], dict[str, Any]]:
    """`n` random-word prompts of about `input_len` prompt tokens (see the module docstring).
    Returns the prompts and a description of how they were made."""
    rng = random.Random(seed)
    vocab = vocabulary()
    prompts: list[Prompt] = []
    overhead = await template_overhead(client, target, tok)
    if overhead is not None:
        raw_len = max(1, input_len - overhead)
        for _ in range(n):
            ids = None
            words = raw_len * 2
            while True:
                ids = await tok.tokenize(random_words(words, rng, vocab))
                if ids is None or len(ids) >= raw_len:
                    break
                words *= 2
            text = await tok.detokenize(ids[:raw_len]) if ids is not None else None
            text = text.strip() if text is not None else None
            back = await tok.tokenize(text) if text else None
            if back is None:
                break
            prompts.append(Prompt([{"role": "user", "content": text}], output_len, True,
                                  expected_prompt_tokens=overhead + len(back)))
        if len(prompts) == n:
            return prompts, {"method": "tokenizer", "tokenizer": tok.kind, "template_overhead_tokens": overhead}
        prompts = []
    # tokenizer-free: fit prompt tokens against word count from two probes' usage
    fit = None
    counts = []
    for words in (100, 300):
        status, body = await complete_once(client, target, Prompt([{"role": "user", "content": random_words(words, random.Random(seed + words), vocab)}], 1))
        usage = body.get("usage") if isinstance(body, dict) else None
        if status == 200 and isinstance(usage, dict) and usage.get("prompt_tokens"):
            counts.append((words, int(usage["prompt_tokens"])))
    if len(counts) == 2:
        slope = (counts[1][1] - counts[0][1]) / (counts[1][0] - counts[0][0])
        icpt = counts[0][1] - slope * counts[0][0]
        if slope > 0:
            fit = (slope, icpt)
    slope, icpt = fit or (1.0, 0.0)
    n_words = max(1, round((input_len - icpt) / slope))
    for _ in range(n):
        prompts.append(Prompt([{"role": "user", "content": random_words(n_words, rng, vocab)}], output_len, True))
    info = {"method": "words-calibrated" if fit else "words-uncalibrated", "words_per_prompt": n_words}
    if fit:
        info.update(tokens_per_word=slope, overhead_tokens=icpt)
    return prompts, info


def builtin_prompts(n: int, output_len: int, seed: int) -> list[Prompt]:
    """The built-in text set as a serving dataset: ~800-character documents with varied tasks."""
    tasks = ["Summarize the following text.", "List the key technical terms in the following text and explain each.",
             "Rewrite the following text for a beginner.", "Write three questions a student might ask about this text."]
    return [Prompt([{"role": "user", "content": f"{tasks[i % len(tasks)]}\n\n{doc}"}], output_len, True)
            for i, doc in enumerate(documents(n, 800, seed + 1))]


def parse_list(text: str | None, kind: type = int) -> list:
    """'1,4,16' -> [1, 4, 16]; rates accept 'inf'."""
    if not text:
        return []
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        v = float("inf") if kind is float and part.lower() == "inf" else kind(part)
        if v <= 0:
            raise ValueError(f"{part!r}: must be > 0")
        out.append(v)
    return out
