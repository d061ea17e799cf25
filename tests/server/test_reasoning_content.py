"""Reasoning content with a scripted thinking model (its output forced, its template one that thinks in
<think> tags): `reasoning_content` is split from `content`, streamed and not; `include_reasoning`
false drops it; the Responses API returns it as a reasoning item; `chat_template_kwargs` (e.g.
enable_thinking) reach the template."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

THINKING_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                     "{% if enable_thinking is false %}<think></think>{% endif %}")
SCRIPT = "<think>\nThe user wants a greeting. Keep it short.\n</think>\n\nHello there!"


@pytest.fixture(scope="module")
def scripted():
    from fake_engine import ScriptedEngine
    from server_support import ThreadedServer

    with ThreadedServer(engine=ScriptedEngine(SCRIPT, chat_template=THINKING_TEMPLATE)) as srv:
        yield srv


@pytest.fixture
def oai(scripted):
    import openai

    with openai.OpenAI(base_url=f"{scripted.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


ASK = [{"role": "user", "content": "Say hi"}]


def test_reasoning_content_split_streamed_and_not(oai):
    r = oai.chat.completions.create(model="fake-model", messages=ASK, max_tokens=40)
    msg = r.choices[0].message
    assert msg.content == "Hello there!"
    assert msg.model_extra["reasoning_content"] == "\nThe user wants a greeting. Keep it short.\n"
    chunks = list(oai.chat.completions.create(model="fake-model", messages=ASK, max_tokens=40, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == msg.content
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        msg.model_extra["reasoning_content"]
    assert not any("<think>" in (d.content or "") for d in deltas)


def test_include_reasoning_false_drops_it(oai):
    r = oai.chat.completions.create(model="fake-model", messages=ASK, max_tokens=40,
                                    extra_body={"include_reasoning": False})
    assert r.choices[0].message.content == "Hello there!"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


def test_responses_api_gives_a_reasoning_item(oai):
    r = oai.responses.create(model="fake-model", input="Say hi", max_output_tokens=40)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text.strip() == "The user wants a greeting. Keep it short."
    assert r.output_text == "Hello there!"


def test_chat_template_kwargs_reach_the_template(scripted):
    from slipstream.server.config import ServerConfig
    from slipstream.server.protocol import ChatCompletionRequest
    from slipstream.server.routes import prepare_chat_request
    from slipstream.server.state import AppState

    state = AppState(scripted.llm, ServerConfig())   # the routes' state over the same fake model
    seen = []
    tok = scripted.llm.tokenizer
    real = tok.apply_chat_template

    def spy(messages, add_generation_prompt=True, tools=None, **kwargs):
        seen.append(kwargs)
        return real(messages, add_generation_prompt, tools, **kwargs)

    tok.apply_chat_template = spy
    try:
        body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
        prepare_chat_request(state, ChatCompletionRequest.model_validate(body))
    finally:
        tok.apply_chat_template = real
    assert seen == [{"enable_thinking": False}]
