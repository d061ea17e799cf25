"""Each tool-call parser on output samples in its model family's format: Qwen2.5/Hermes, Llama 3.1,
Mistral (v3 list and v11 [ARGS] forms), DeepSeek-V3 / V3.1 and GLM-4.5 (one sample as a GLM-4.5-Air
user reported it, spaces where the model put newlines). The chat-template detection picks each from
the markers its template writes."""
from __future__ import annotations

import json

import pytest

from slipstream.structured.tool_parsers import make_parser, parser_for_template, template_has_tools

WEATHER = {"city": "Paris", "unit": "celsius"}

SAMPLES = {
    # Qwen2.5-7B-Instruct: a short preamble, then one block per call, each JSON on its own line
    "hermes": ('I\'ll check both for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": '
               '"Europe/Paris"}}\n</tool_call>', "I'll check both for you."),
    # Llama-3.1-8B-Instruct with JSON-based tool calling: the bare object, "parameters" for arguments
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}', ""),
    # Mistral-7B-Instruct-v0.3: [TOOL_CALLS] then a JSON list
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', ""),
    # DeepSeek-V3-0324: function<sep>name, the arguments in a fenced json block
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
                    '<｜tool▁sep｜>get_time\n```json\n{"tz": "Europe/Paris"}\n```<｜tool▁call▁end｜>'
                    '<｜tool▁calls▁end｜>',
                    ""),
    # GLM-4.5: name on the first line, one key/value tag pair per argument
    "glm45": ("Let me look that up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>\n<tool_call>get_time\n"
              "<arg_key>tz</arg_key>\n<arg_value>Europe/Paris</arg_value>\n</tool_call>", "Let me look that up."),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_format_gives_both_calls_and_the_content(name):
    text, content = SAMPLES[name]
    got_content, calls = make_parser(name).parse(text)
    assert got_content == content
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == WEATHER
    assert json.loads(calls[1].arguments) == {"tz": "Europe/Paris"}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_plain_answers_are_no_calls(name):
    text = "The weather in Paris is mild today."
    assert make_parser(name).parse(text) == (text, [])


def test_llama3_python_tag_and_mistral_v11_and_deepseek_v31():
    _, calls = make_parser("llama3_json").parse('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]
    _, calls = make_parser("mistral").parse('[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]
    # V3.1 drops the "function" type and the fence
    _, calls = make_parser("deepseek_v3").parse(
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "UTC"}<｜tool▁call▁end｜>'
        '<｜tool▁calls▁end｜>')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]


def test_glm45_types_values_by_the_tool_schema():
    reported = ("Let me search for configuration files in the backend directory to help locate this information: "
                "<tool_call>ls <arg_key>dirPath</arg_key> <arg_value>backend</arg_value> </tool_call>")
    content, calls = make_parser("glm45").parse(reported)
    assert content.startswith("Let me search") and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("ls", {"dirPath": "backend"})]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "n": {"type": "integer"}}}}}]
    _, calls = make_parser("glm45", tools).parse(
        "<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>42</arg_value>\n<arg_key>n</arg_key>\n<arg_value>42"
        "</arg_value>\n</tool_call>")
    assert json.loads(calls[0].arguments) == {"code": "42", "n": 42}


def test_a_call_cut_off_by_max_tokens_is_not_invented():
    assert make_parser("hermes").parse('<tool_call>\n{"name": "get_weather", "argum')[1] == []


@pytest.mark.parametrize("template,parser", [
    ("{%- if tools %}<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json>}\\n</tool_call>", "hermes"),
    ("{%- if tools %}{{- '<tool_call>' + tool_call.name }}{% for k, v in a %}<arg_key>{{ k }}</arg_key>", "glm45"),
    ("{% if tools %}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + t['type'] + '<｜tool▁sep｜>'}}", "deepseek_v3"),
    ("{{- \"[AVAILABLE_TOOLS] \" }}{{- tools|tojson }}{{- \"[TOOL_CALLS] \" }}", "mistral"),
    ("{%- if builtin_tools is defined or tools is not none %}{{- \"<|python_tag|>\" }}", "llama3_json"),
    ("{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'}}", None),
])
def test_the_parser_is_picked_from_the_template(template, parser):
    assert parser_for_template(template) == parser
    assert template_has_tools(template) == (parser is not None)


def test_hermes_arguments_first_as_its_system_prompt_asks():
    """Hermes 2 Pro / Hermes 3's own tool prompt asks for {"arguments": ..., "name": ...} inside
    <tool_call> tags (arguments first), the order those models emit."""
    text = ('<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>')
    content, calls = make_parser("hermes").parse(text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_stock_fundamentals", {"symbol": "TSLA"})]
