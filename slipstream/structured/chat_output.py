"""One chat choice's generated text turned into what the API returns: content, reasoning content
and tool calls, as streamed deltas and as the final message. A non-streamed answer runs through
the same object (all its text fed at once), so the streamed deltas always reassemble into the
non-streamed message.

Tool modes: None (no tools, or tool_choice "none"), "auto" (the model's own format, read by a
parser; text from the parser's start marker on is held back until the answer ends), "required"
(the answer is a constrained JSON array of calls), "named" (the answer is the named function's
constrained arguments, streamed as argument fragments as they come).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from slipstream.structured.reasoning import ReasoningSplitter
from slipstream.structured.tool_parsers import ToolCall, ToolParser
from slipstream.structured.tool_schema import parse_required

ToolMode = Literal["auto", "required", "named"]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class OutputConfig:
    """How a request's choices are read (shared by its choices; each gets its own ChatOutput)."""

    tool_mode: ToolMode | None = None
    parser: ToolParser | None = None       # auto
    function: str | None = None            # named
    reasoning: bool = False                # split <think>...</think> off
    in_reasoning: bool = False             # the prompt opened the <think> block
    include_reasoning: bool = True         # return the reasoning (else it is dropped)

    def new(self) -> ChatOutput:
        return ChatOutput(self)


@dataclass
class ChatOutput:
    cfg: OutputConfig
    content_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._splitter = ReasoningSplitter(self.cfg.in_reasoning) if self.cfg.reasoning else None
        self._held = ""          # content that may start a tool call (auto) or is a tool call
        self._buffering = False  # auto: the start marker was seen; everything from it is held
        self._seen_content = False
        self._named_id: str | None = None
        self._ws = ""            # auto: whitespace after the visible content, not sent yet

    # -- streaming ----------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas (`{"content": ...}`, `{"reasoning_content": ...}`, `{"tool_calls": [...]}`) for a piece."""
        if not text:
            return []
        if self._splitter is None:
            return self._content(text)
        reasoning, content = self._splitter.feed(text)
        return self._reasoning(reasoning) + self._content(content)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held back, once the answer has ended."""
        out: list[dict[str, Any]] = []
        if self._splitter is not None:
            reasoning, content = self._splitter.flush()
            out += self._reasoning(reasoning) + self._content(content)
        mode = self.cfg.tool_mode
        held, self._held = self._held, ""
        if mode == "required":
            calls = [ToolCall(n, a) for n, a in parse_required(held)]
            out += self._calls(calls) if calls else self._plain(held)
        elif mode == "auto" and held:
            assert self.cfg.parser is not None
            rest, calls = self.cfg.parser.parse(held)
            if calls:
                out += self._plain(rest) + self._calls(calls)
            else:
                out += self._plain(self._ws + held)
        elif mode == "auto":
            out += self._plain(self._ws)
        self._ws = ""
        return out

    # -- the final message --------------------------------------------------------------------------
    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return None if self.tool_calls and not text.strip() else text

    @property
    def reasoning(self) -> str | None:
        if not self.cfg.reasoning or not self.cfg.include_reasoning or not self.reasoning_parts:
            return None
        return "".join(self.reasoning_parts)

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason

    # -- pieces ---------------------------------------------------------------------------------
    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.reasoning_parts.append(text)
        return [{"reasoning_content": text}] if self.cfg.include_reasoning else []

    def _plain(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.content_parts.append(text)
        return [{"content": text}]

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        mode = self.cfg.tool_mode
        if mode is None:
            return self._plain(text)
        if mode == "required":
            self._held += text
            return []
        if mode == "named":
            return self._named(text)
        return self._auto(text)

    def _named(self, text: str) -> list[dict[str, Any]]:
        assert self.cfg.function is not None
        out = []
        if self._named_id is None:
            self._named_id = call_id()
            self.tool_calls.append({"id": self._named_id, "type": "function",
                                    "function": {"name": self.cfg.function, "arguments": ""}})
            out.append({"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                        "function": {"name": self.cfg.function, "arguments": ""}}]})
        self.tool_calls[0]["function"]["arguments"] += text
        out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def _auto(self, text: str) -> list[dict[str, Any]]:
        parser = self.cfg.parser
        assert parser is not None
        if self._buffering:
            self._held += text
            return []
        text = self._held + text
        self._held = ""
        if parser.name == "llama3_json" and not self._seen_content:
            # Llama 3 answers a call with bare JSON (or <|python_tag|>) from its first character
            head = text.lstrip()
            if not head or head.startswith("{") or head.startswith(parser.start) or parser.start.startswith(head):
                self._buffering = head.startswith("{") or head.startswith(parser.start)
                self._held = text
                return []
        i = text.find(parser.start)
        if i >= 0:
            self._buffering = True
            self._held = text[i:]
            return self._visible(text[:i])
        k = _partial_suffix(text, parser.start)
        self._held = text[len(text) - k:] if k else ""
        return self._visible(text[:len(text) - k])

    def _visible(self, text: str) -> list[dict[str, Any]]:
        """Content before any tool call; trailing whitespace waits (it is dropped before a call)."""
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body.strip():
            self._seen_content = True
        return self._plain(body)

    def _calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for c in calls:
            i = len(self.tool_calls)
            cid = call_id()
            self.tool_calls.append({"id": cid, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}})
            out.append({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                        "function": {"name": c.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
        return out


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
