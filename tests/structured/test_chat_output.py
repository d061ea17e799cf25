"""A choice's text read into content, reasoning and tool calls: the streamed deltas, however the text
is chunked, reassemble into the non-streamed message."""
from __future__ import annotations

import json

import pytest

from slipstream.structured.chat_output import OutputConfig
from slipstream.structured.tool_parsers import make_parser


def _run(cfg: OutputConfig, text: str, size: int) -> tuple[dict, list[dict]]:
    o = cfg.new()
    deltas = []
    for i in range(0, len(text), size):
        deltas += o.feed(text[i:i + size])
    deltas += o.finish()
    return o.message(), deltas


def _reassemble(deltas: list[dict]) -> dict:
    """What a client (the openai SDK's stream helper) builds from the deltas."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    for d in deltas:
        msg["content"] += d.get("content") or ""
        msg["reasoning_content"] += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            if "id" in tc:
                assert tc["index"] == len(msg["tool_calls"]) and tc["function"]["arguments"] == ""
                msg["tool_calls"].append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            msg["tool_calls"][tc["index"]]["arguments"] += tc["function"].get("arguments", "")
    return msg


CASES = [
    (OutputConfig(tool_mode="auto", parser=make_parser("hermes")),
     'Checking.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Checking.", [("f", {"a": 1})]),
    (OutputConfig(tool_mode="auto", parser=make_parser("hermes")), "No call <tool here.", "No call <tool here.", []),
    (OutputConfig(tool_mode="auto", parser=make_parser("llama3_json")),
     ' {"name": "f", "parameters": {"a": 2}}', None, [("f", {"a": 2})]),
    (OutputConfig(tool_mode="required"), '[{"name":"f","arguments":{"a":3}},{"name":"g","arguments":{}}]', None,
     [("f", {"a": 3}), ("g", {})]),
    (OutputConfig(tool_mode="named", function="f"), '{"a":4}', None, [("f", {"a": 4})]),
    (OutputConfig(tool_mode="auto", parser=make_parser("hermes"), reasoning=True),
     '<think>I should call f.</think>\n\n<tool_call>{"name": "f", "arguments": {"a": 5}}</tool_call>', None,
     [("f", {"a": 5})]),
]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_streamed_deltas_reassemble_into_the_message(case, size):
    cfg, text, content, calls = CASES[case]
    whole, _ = _run(cfg, text, len(text) + 1)
    msg, deltas = _run(cfg, text, size)
    got = _reassemble(deltas)
    assert (msg["content"] or "").strip() == (whole["content"] or "").strip() == got["content"].strip()
    if content is None:
        assert not (whole["content"] or "").strip()
    else:
        assert whole["content"].strip() == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == calls
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.get("tool_calls", [])] \
        == calls
    if cfg.reasoning:
        assert whole["reasoning_content"] == got["reasoning_content"] == "I should call f."


def test_finish_reason_and_dropped_reasoning():
    o = OutputConfig(tool_mode="named", function="f").new()
    o.feed("{}")
    o.finish()
    assert o.finish_reason("stop") == "tool_calls" and o.finish_reason("length") == "length"
    o = OutputConfig(reasoning=True, include_reasoning=False).new()
    assert o.feed("<think>secret</think>shown") == [{"content": "shown"}]
    assert o.message() == {"role": "assistant", "content": "shown"}
