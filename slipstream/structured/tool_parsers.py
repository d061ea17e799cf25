"""Tool calls out of a model's text, one parser per format models are trained to emit.

    hermes      Hermes / Qwen2.5 / Qwen3:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json Llama 3.1-3.3:             {"name": ..., "parameters": {...}}  (optionally after <|python_tag|>,
                                           several separated by ';')
    mistral     Mistral:                   [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                                           or the v11 tokenizer's [TOOL_CALLS]name[ARGS]{...}
    deepseek_v3 DeepSeek-V3 / R1 / V3.1:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name
                                           ```json {...} ```<｜tool▁call▁end｜>... (V3.1: name<｜tool▁sep｜>{...})
    glm45       GLM-4.5 / GLM-4.6 / GLM-5: <tool_call>name <arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>

`parse(text)` returns the content left once the calls are taken out and the calls (arguments as a
JSON string, as the OpenAI API carries them). `start` is the marker that opens the calls, so a
streaming caller knows from where to hold text back. `parser_for_template` picks a parser from the
chat template's own markers.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str      # a JSON object, as text


def _arguments(value: Any) -> str:
    if isinstance(value, str):   # some models emit the arguments as a JSON string already
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], _arguments(args))


def _json_values(text: str) -> list[Any]:
    """Every JSON value in `text`, one after the other (separators and whitespace between them skipped)."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            break
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            break
        out.append(value)
    return out


class ToolParser:
    name = "base"
    start = ""                     # the text that opens the tool calls

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _call_re = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in self._call_re.findall(text):
            for value in _json_values(body.strip()):
                call = _call(value)
                if call is not None:
                    calls.append(call)
        if not calls:
            return text, []
        return text[:text.index(self.start)].strip(), calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        prefix = ""
        if self.start in body:
            prefix, body = body.split(self.start, 1)
            body = body.strip()
        if not body.startswith("{"):
            return text, []
        values = _json_values(body)
        calls = [c for c in (_call(v) for v in values) if c is not None]
        if not calls or len(calls) != len(values):
            return text, []
        return prefix.strip(), calls


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        content, rest = text.split(self.start, 1)
        calls: list[ToolCall] = []
        if "[ARGS]" in rest:    # v11: name[ARGS]{...}, repeated after further [TOOL_CALLS]
            for part in rest.split(self.start):
                if "[ARGS]" not in part:
                    continue
                name, args = part.split("[ARGS]", 1)
                values = _json_values(args.strip())
                if name.strip() and values:
                    calls.append(ToolCall(name.strip(), _arguments(values[0])))
        else:
            for value in _json_values(rest.strip()):
                for item in value if isinstance(value, list) else [value]:
                    call = _call(item)
                    if call is not None:
                        calls.append(call)
        if not calls:
            return text, []
        return content.strip(), calls


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    start = "<｜tool▁calls▁begin｜>"
    _call_re = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.S)
    _fenced = re.compile(r"^\s*([^\n]*)\n```(?:json)?\s*(.*?)\s*```\s*$", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for head, body in self._call_re.findall(text):
            if head.strip() == "function" or head.strip() == "":   # V3 / R1: function<sep>name\n```json ...```
                m = self._fenced.match(body)
                if m is None:
                    continue
                name, args = m.group(1).strip(), m.group(2)
            else:                                                 # V3.1: name<sep>{...}
                name, args = head.strip(), body
            values = _json_values(args.strip())
            if name and values:
                calls.append(ToolCall(name, _arguments(values[0])))
        if not calls:
            return text, []
        return text[:text.index(self.start)].strip(), calls


class Glm45Parser(ToolParser):
    name = "glm45"
    start = "<tool_call>"
    _call_re = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
    _arg_re = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        # parameter types per function: a string parameter's value is taken as it is written
        self._types: dict[str, dict[str, Any]] = {}
        for t in tools or []:
            fn = t.get("function", t)
            props = (fn.get("parameters") or {}).get("properties") or {}
            self._types[fn.get("name", "")] = {k: (v or {}).get("type") for k, v in props.items()}

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in self._call_re.findall(text):
            name = body.split("<arg_key>", 1)[0].strip()
            if not name or name.startswith("{"):
                continue
            types = self._types.get(name, {})
            args: dict[str, Any] = {}
            for key, raw in self._arg_re.findall(body):
                key = key.strip()
                args[key] = raw if types.get(key) == "string" else _value(raw)
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        return text[:text.index(self.start)].strip(), calls


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


PARSERS: dict[str, Callable[..., ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
    "deepseek_v3": DeepSeekV3Parser, "glm45": Glm45Parser,
}


def make_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r} ({', '.join(PARSERS)})")
    return Glm45Parser(tools) if name == "glm45" else PARSERS[name]()


def parser_for_template(template: str | None) -> str | None:
    """The parser whose format a chat template writes, or None when the template has no tool format."""
    t = template or ""
    if "<arg_key>" in t:
        return "glm45"
    if "tool▁calls▁begin" in t or "tool▁call▁begin" in t:
        return "deepseek_v3"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("ipython" in t and "<|eot_id|>" in t):
        return "llama3_json"
    return None


def template_has_tools(template: str | None) -> bool:
    """Whether a chat template renders a `tools` list (otherwise the server describes the tools itself)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None
