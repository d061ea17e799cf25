"""The Responses API through the real `openai` client against the live default-model server: text,
streamed typed events (the SDK's stream helper assembles them), structured output (`responses.parse`
with a pydantic model), function tools with a forced call, a function_call_output round trip, and
a clean 400 for previous_response_id."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance", reason="llguidance (structured output) is not installed")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER, "strict": True}]


def test_text_and_stream_agree(client):
    r = client.responses.create(model=MODEL, input="Name a color.", instructions="Answer in one word.",
                                max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    with client.responses.stream(model=MODEL, input="Name a color.", instructions="Answer in one word.",
                                 max_output_tokens=24, temperature=0) as s:
        events = list(s)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in types and types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output[0].content[0].text == r.output_text


def test_structured_output_with_parse(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=16)
        country: str = Field(max_length=16)

    r = client.responses.parse(model=MODEL, input="Tell me about Paris.", text_format=City, max_output_tokens=40,
                               temperature=0)
    assert isinstance(r.output_parsed, City) and r.output_parsed.city


def test_forced_function_call_and_its_output(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Oslo?", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    with client.responses.stream(model=MODEL, input="What is the weather in Oslo?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                 temperature=0) as s:
        final = s.get_final_response()
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == \
        [(calls[0].name, calls[0].arguments)]
    # the next turn carries the call and its result as input items
    follow = client.responses.create(model=MODEL, tools=TOOLS, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 3}'}])
    assert follow.status in ("completed", "incomplete") and follow.output


def test_previous_response_id_is_a_clean_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert e.value.body["code"] == "previous_response_not_supported"
    assert e.value.body["param"] == "previous_response_id"
