"""Tool definitions and what tool_choice makes of them.

`tool_choice="required"` constrains the whole answer to a JSON array of calls, each
`{"name": <one of the tools>, "arguments": <that tool's parameters schema>}` (one call when
`parallel_tool_calls` is false); a named function constrains the answer to that function's
arguments. Either way even a small model returns arguments that parse and validate.

Templates without tool support get the tools described in a system message (`describe_tools`),
asking for the Hermes `<tool_call>` format, which the Hermes parser then reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slipstream.structured.constraint import Constraint, ConstraintError

_OPEN_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


def tool_from_openai(fn: dict[str, Any], where: str) -> Tool:
    """A tool from the function object of a chat `tools` entry (or a Responses tool, which is flat)."""
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConstraintError(f"{where}: a function tool needs a non-empty 'name'", "invalid_tool")
    if len(name) > 64 or not all(ch.isalnum() or ch in "_-." for ch in name):
        raise ConstraintError(f"{where}: the function name {name[:80]!r} must be at most 64 letters, digits, "
                              "'_', '-' or '.'", "invalid_tool")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ConstraintError(f"{where}: 'parameters' must be a JSON schema object", "invalid_tool")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ConstraintError(f"{where}: 'description' must be a string", "invalid_tool")
    return Tool(name, desc, params)


def check_unique(tools: list[Tool]) -> None:
    seen: set[str] = set()
    for t in tools:
        if t.name in seen:
            raise ConstraintError(f"two tools are named {t.name!r}", "invalid_tool")
        seen.add(t.name)


def _arguments_schema(t: Tool) -> dict[str, Any]:
    return t.parameters if t.parameters else _OPEN_OBJECT


def required_constraint(tools: list[Tool], parallel: bool) -> Constraint:
    """The answer is a JSON array of calls to the given tools (exactly one when not parallel)."""
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": t.name}, "arguments": _arguments_schema(t)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return Constraint.json_schema(schema)


def named_constraint(tool: Tool) -> Constraint:
    """The answer is the named function's arguments."""
    return Constraint.json_schema(_arguments_schema(tool))


def parse_required(text: str) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each call in a `required` answer; an answer cut short (max_tokens)
    gives its complete calls; [] if nothing parses."""
    try:
        calls = json.loads(text)
    except ValueError:
        calls = _complete_items(text)
    if not isinstance(calls, list):
        return []
    out = []
    for c in calls:
        if isinstance(c, dict) and isinstance(c.get("name"), str):
            out.append((c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False)))
    return out


def _complete_items(text: str) -> list[Any]:
    """The complete values of a JSON array whose end was cut off."""
    body = text.lstrip()
    if not body.startswith("["):
        return []
    dec, i = json.JSONDecoder(), 1
    out: list[Any] = []
    while True:
        while i < len(body) and body[i] in " \t\r\n,":
            i += 1
        try:
            value, i = dec.raw_decode(body, i)
        except ValueError:
            return out
        out.append(value)


def describe_tools(tools: list[Tool]) -> str:
    """A system-message description of the tools for templates that cannot render them."""
    listing = "\n".join(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in tools)
    return ("You can call these functions. Each line describes one as JSON:\n"
            f"{listing}\n"
            "To call a function, answer with one block per call, exactly:\n"
            '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
            "Answer normally when no function is needed.")
