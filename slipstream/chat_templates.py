"""Chat templates for GGUF files that carry none (as llama.cpp does): the family is recognised from
the special tokens of its vocabulary, and its well-known prompt format is used instead.

Each template is a Jinja template over `messages` (role/content), `bos_token` and
`add_generation_prompt`, rendered by the tokenizer like a template read from a file.
"""
from __future__ import annotations

from typing import Iterable

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% set sys = namespace(text='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set sys.text = m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if loop.first or loop.index0 == 1 and messages[0]['role'] == 'system' %}{{ sys.text }}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% set sys = namespace(text='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set sys.text = m['content'] + '\n\n' %}"
    "{% elif m['role'] == 'user' %}[INST] {{ sys.text }}{{ m['content'] }} [/INST]{% set sys.text = '' %}"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
PHI3 = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# family -> (the tokens that identify it, all required; its template); first match wins
FAMILIES: dict[str, tuple[tuple[str, ...], str]] = {
    "llama3": (("<|start_header_id|>", "<|eot_id|>"), LLAMA3),
    "gemma": (("<start_of_turn>", "<end_of_turn>"), GEMMA),
    "chatml": (("<|im_start|>", "<|im_end|>"), CHATML),
    "phi3": (("<|user|>", "<|assistant|>", "<|end|>"), PHI3),
    "mistral": (("[INST]", "[/INST]"), MISTRAL),
}


def family_template(vocab: Iterable[str]) -> tuple[str, str] | None:
    """(family name, template) for a vocabulary holding a known family's chat tokens, else None."""
    markers = {t for m, _ in FAMILIES.values() for t in m}
    tokens = {t for t in vocab if t in markers}   # one pass, keeping only the markers
    for name, (markers, template) in FAMILIES.items():
        if all(t in tokens for t in markers):
            return name, template
    return None
