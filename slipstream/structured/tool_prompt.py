"""The conversation as the chat template receives it when tools are involved.

A template that renders `tools` (and the tool messages and calls of the history) gets them as they
are. A template without tool support gets the documented fallback: the tools described in the
system message (asking for Hermes `<tool_call>` blocks), earlier assistant calls written back as
such blocks, and tool results as user messages wrapped in `<tool_response>`, so any template that
renders plain role/content messages can hold a tool conversation.
"""
from __future__ import annotations

import json
from typing import Any

from slipstream.structured.tool_schema import Tool, describe_tools


def template_messages(messages: list[dict[str, Any]], tools: list[Tool], template_renders_tools: bool,
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to pass to the chat template."""
    if template_renders_tools:
        return messages, ([t.as_openai() for t in tools] or None)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                 ensure_ascii=False) for c in m["tool_calls"]]
            text = "\n".join(f"<tool_call>{b}</tool_call>" for b in blocks)
            content = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if tools:
        note = describe_tools(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, None
