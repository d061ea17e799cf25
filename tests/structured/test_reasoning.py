"""<think> blocks split from the answer, whole and streamed in any chunking."""
from __future__ import annotations

import pytest

from slipstream.structured.reasoning import ReasoningSplitter, split, starts_in_reasoning, uses_reasoning

R1_ANSWER = "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is **4**."


def _stream(text: str, size: int, in_reasoning: bool = False) -> tuple[str, str]:
    s = ReasoningSplitter(in_reasoning)
    r, c = "", ""
    for i in range(0, len(text), size):
        a, b = s.feed(text[i:i + size])
        r, c = r + a, c + b
    a, b = s.flush()
    return r + a, c + b


def test_split_whole():
    assert split(R1_ANSWER) == ("\nThe user asks 2+2. That is 4.\n", "The answer is **4**.")
    assert split("No thinking here.") == (None, "No thinking here.")
    assert split("still thinking", in_reasoning=True) == ("still thinking", "")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 100])
def test_streamed_pieces_reassemble_like_the_whole(size):
    reasoning, content = split(R1_ANSWER)
    assert _stream(R1_ANSWER, size) == (reasoning, content)
    # a template that opened <think> in the prompt: the answer starts inside it
    text = "Let me see.</think>Paris."
    assert _stream(text, size, in_reasoning=True) == split(text, in_reasoning=True) == ("Let me see.", "Paris.")


def test_a_lookalike_tag_is_content():
    assert split("<thinking is fun>") == (None, "<thinking is fun>")
    assert _stream("<th", 1) == ("", "<th")


def test_template_detection():
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    assert uses_reasoning(qwen3)
    assert not uses_reasoning("{{ message['content'] }}")
    assert starts_in_reasoning("<|Assistant|><think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n")
