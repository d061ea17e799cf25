"""Tool calling through the real `openai` client and LangChain against live servers.

On the default model (SmolLM2's template has no tool support: the server's documented fallback
describes the tools in the system message): tool_choice "required" and a named function give
arguments that parse and validate against the function's schema, streamed deltas reassemble into
the non-streamed calls, a tool conversation (assistant tool_calls + tool results) is accepted.
With a scripted model (its output forced, its template Hermes-style) tool_choice "auto" returns the
parsed calls with finish_reason "tool_calls", streamed exactly as OpenAI streams them."""
from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="llguidance (structured output) is not installed")

MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def _check_calls(calls) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _reassemble(chunks) -> tuple[list[tuple[str, str]], str | None]:
    calls: list[list[str]] = []
    finish = None
    for ch in chunks:
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            if tc.id is not None:   # the first delta of a call: index, id, type and name
                assert tc.index == len(calls) and tc.type == "function" and tc.function.name
                calls.append([tc.function.name, tc.function.arguments or ""])
            else:
                calls[tc.index][1] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return [(n, a) for n, a in calls], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_required_and_named_give_valid_arguments_streamed_and_not(client, choice):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
              max_tokens=48, temperature=0)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    _check_calls(msg.tool_calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in msg.tool_calls] == ["get_time"]
    streamed, finish = _reassemble(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert streamed == [(c.function.name, c.function.arguments) for c in msg.tool_calls]


def test_sampled_required_calls_validate(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=48, temperature=1.0, n=3, seed=5)
    for c in r.choices:
        _check_calls(c.message.tool_calls)


def test_a_tool_conversation_renders_through_the_fallback(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens > 60   # the history and the tool result are in the prompt


def test_langchain_bind_tools(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_time(timezone: str) -> str:
        """Current time in a timezone."""
        return "12:00"

    llm = lc.ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key="unused", temperature=0, max_tokens=48,
                        max_retries=0)
    msg = llm.bind_tools([get_time], tool_choice="get_time").invoke("What time is it in Tokyo?")
    assert [c["name"] for c in msg.tool_calls] == ["get_time"]
    assert isinstance(msg.tool_calls[0]["args"].get("timezone"), str)


# -- tool_choice "auto" with a scripted model -------------------------------------------------------------

HERMES_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if tools %}<tool_call>{% endif %}"
SCRIPT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def scripted():
    pytest.importorskip("fastapi")
    from fake_engine import ScriptedEngine
    from server_support import ThreadedServer

    with ThreadedServer(engine=ScriptedEngine(SCRIPT, chat_template=HERMES_TEMPLATE, chars_per_step=16)) as srv:
        yield srv


def test_auto_returns_the_parsed_calls(scripted):
    import openai

    with openai.OpenAI(base_url=f"{scripted.base_url}/v1", api_key="unused", max_retries=0) as c:
        kw = dict(model="fake-model", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                  max_tokens=40)
        r = c.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert msg.content == "Let me check."
        assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
            ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]
        chunks = list(c.chat.completions.create(stream=True, **kw))
        streamed, finish = _reassemble(chunks)
        assert finish == "tool_calls"
        assert streamed == [(t.function.name, t.function.arguments) for t in msg.tool_calls]
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert content.strip() == msg.content and "<tool_call>" not in content
        # tool_choice "none": the text as it is, no parsing
        r = c.chat.completions.create(tool_choice="none", **kw)
        assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
