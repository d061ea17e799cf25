"""Reasoning content: the `<think>...</think>` part of a thinking model's answer, kept apart.

DeepSeek-R1, Qwen3 and GLM-4.5 write their reasoning between `<think>` and `</think>` before the
answer; some templates open the `<think>` in the prompt, so the answer starts inside it
(`starts_in_reasoning`). `split` takes a whole text; `ReasoningSplitter` does the same on a stream of
text pieces, holding back only what could be the start of a tag.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def uses_reasoning(template: str | None) -> bool:
    """Whether a chat template belongs to a model that thinks in <think> tags."""
    return bool(template) and CLOSE in (template or "")


def starts_in_reasoning(prompt: str) -> bool:
    """The prompt opened a <think> block the answer continues (R1-style templates)."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


def split(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    s = ReasoningSplitter(in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    reasoning = r1 + r2
    return (reasoning if s.saw_reasoning else None), c1 + c2


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Feed text pieces; get (reasoning, content) pieces back."""

    def __init__(self, in_reasoning: bool = False):
        self.state = "reasoning" if in_reasoning else "start"
        self.saw_reasoning = in_reasoning
        self._held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text = self._held + piece
        self._held = ""
        reasoning, content = "", ""
        while text:
            if self.state == "start":          # only whitespace so far: a <think> may still open
                stripped = text.lstrip()
                if not stripped:
                    self._held = text
                    break
                if stripped.startswith(OPEN):
                    self.state, self.saw_reasoning = "reasoning", True
                    text = stripped[len(OPEN):]
                    continue
                if OPEN.startswith(stripped):
                    self._held = text
                    break
                self.state = "content"
                continue
            if self.state == "reasoning":
                i = text.find(CLOSE)
                if i >= 0:
                    reasoning += text[:i]
                    text = text[i + len(CLOSE):].lstrip("\n")
                    self.state = "after"
                    continue
                k = _partial_suffix(text, CLOSE)
                reasoning += text[:len(text) - k]
                self._held = text[len(text) - k:]
                break
            if self.state == "after":   # the newlines between </think> and the answer are not content
                text = text.lstrip("\n")
                if not text:
                    break
            self.state = "content"
            content += text
            break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held if self.state == "content" or held.strip() else ""
